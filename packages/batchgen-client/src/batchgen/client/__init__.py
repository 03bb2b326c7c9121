"""batchgen client: sync and async HTTP clients and the `batchgen` CLI."""
