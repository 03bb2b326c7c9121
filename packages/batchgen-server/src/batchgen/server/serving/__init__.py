"""OpenAI request bodies <-> engine requests and results; shared by the REST server (batches and online requests)
and ``run-batch``."""

from .answers import error_line, failed
from .errors import RequestRejected
from .openai_serving import OpenAIServing
from .preparing import PreparedRequest
from .sampling import BatchDefaults

__all__ = ["BatchDefaults", "OpenAIServing", "PreparedRequest", "RequestRejected", "error_line", "failed"]
