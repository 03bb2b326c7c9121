"""A model split over several processes (``--tensor-parallel-size``): ``plan`` (what can be split how many ways, and
the flags that go with it), ``channel`` (each step's packed inputs broadcast from the driver as tensors), ``rank``
(a worker rank's process: its shard, its share of the KV cache, the driver's forwards run again), ``group`` (the
driver's side: starting the ranks, mirroring each forward, declaring the group dead and starting it again). See
docs/scaling.md."""
