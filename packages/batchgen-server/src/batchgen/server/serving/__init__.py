"""OpenAI request bodies <-> engine requests and results; shared by the REST server (batches and online requests)
and ``run-batch``."""

from .errors import RequestRejected
from .openai_serving import BatchDefaults, OpenAIServing, PreparedRequest, failed

__all__ = ["BatchDefaults", "OpenAIServing", "PreparedRequest", "RequestRejected", "failed"]
