"""The model runner: a step's inputs, its forward and sampling, CUDA graphs, the caches' memory budget."""
