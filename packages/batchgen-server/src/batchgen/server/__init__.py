"""batchgen server: the Files and Batches REST API over batchgen's own continuous-batching engine."""
