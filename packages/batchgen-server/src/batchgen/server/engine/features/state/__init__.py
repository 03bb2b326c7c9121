"""State layers beside the paged KV cache: the recurrent mixers and short convolutions of hybrid and state-space
models (Qwen3-Next, Qwen3.5, Mamba 2, Jamba, LFM2...), each sequence's state in a slot of the state cache, prefix
checkpoints in others. ``discovery`` finds the layers at load, ``cache`` holds the slots, ``slots`` hands them out,
``step`` lays out a step for them, ``facade`` and ``mixers`` run each layer's own forward over them."""
