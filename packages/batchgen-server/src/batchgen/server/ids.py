"""Object ids: ``file-<hex>`` and ``batch_<hex>`` as OpenAI spells them (output lines use ``batch_req_<hex>``)."""

from __future__ import annotations

import secrets


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


def new_request_id() -> str:
    return f"req_{secrets.token_hex(16)}"
