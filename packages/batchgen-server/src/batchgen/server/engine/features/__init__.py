"""What a step may carry besides tokens: LoRA adapters, hybrid models' state layers, images, pooling."""
