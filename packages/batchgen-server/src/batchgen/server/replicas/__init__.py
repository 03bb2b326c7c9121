"""Engine replicas on Ray (``--replicas N``): N engines, one per GPU or per process, behind one pool that the batch
loop drives like the single in-process engine worker. Storage, the API and the loop stay in the server's process.

``config`` (the flags) and ``pool`` import nothing heavy; only ``ray_cluster`` imports Ray, and only when replicas
are asked for, so the default single-engine path never loads it.
"""
