"""A checkpoint loaded: the model and its tokenizer (``loader``), quantization, the split plan of a group's shards
(``split``), what a checkpoint is served as (``pooling_spec``), the demo model."""
