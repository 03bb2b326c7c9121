"""The engine's core: its step (schedule, run, process outputs: ``engine``), the scheduler and what it decides with
(the block manager and its prefix cache, the block tables, twins, step costs), the outputs committed, and the encoder
engine of encoder-only models."""
