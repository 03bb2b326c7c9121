"""Every id the server mints, made here and nowhere else: ``file-<hex>`` and ``batch_<hex>`` as OpenAI spells them,
``batch_req_<hex>`` for output lines, ``req_<hex>`` for a request line, ``req_<hex>#<i>`` for the engine request
of its i-th prompt, and ``call_<hex>`` for a tool call."""

from __future__ import annotations

import secrets


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


def new_line_id() -> str:
    return f"batch_req_{secrets.token_hex(16)}"


def new_request_id() -> str:
    return f"req_{secrets.token_hex(16)}"


def new_tool_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def engine_request_id(request_id: str, index: int) -> str:
    """Only minted, never parsed: results find their line through a map keyed by this id."""
    return f"{request_id}#{index}"
