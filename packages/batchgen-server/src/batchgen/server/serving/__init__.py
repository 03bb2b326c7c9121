"""OpenAI request bodies <-> engine requests and results; shared by the REST server and ``run-batch``."""

from .openai_serving import BatchDefaults, OpenAIServing, RequestRejected

__all__ = ["BatchDefaults", "OpenAIServing", "RequestRejected"]
