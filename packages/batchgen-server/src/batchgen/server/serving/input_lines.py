"""Decode one batch input line, its body typed by its ``url``."""

from __future__ import annotations

import msgspec

from batchgen.schemas import BODY_TYPES, BatchInputLine

from .openai_serving import RequestRejected


class _RawInputLine(msgspec.Struct):
    custom_id: str
    method: str
    url: str
    body: msgspec.Raw


_RAW = msgspec.json.Decoder(_RawInputLine)
_BODY_DECODERS = {url: msgspec.json.Decoder(body_type) for url, body_type in BODY_TYPES.items()}


def decode_input_line(line: bytes | str) -> BatchInputLine:
    """Raise ``RequestRejected`` (code ``invalid_request``) with msgspec's message when the line is malformed."""
    try:
        raw = _RAW.decode(line)
    except msgspec.ValidationError as exc:
        raise RequestRejected("invalid_request", f"Invalid batch input line: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise RequestRejected("invalid_json", f"Invalid JSON: {exc}") from exc
    decoder = _BODY_DECODERS.get(raw.url)
    if decoder is None:
        raise RequestRejected("invalid_url", f"Unsupported url {raw.url!r}; use one of {sorted(BODY_TYPES)}", "url")
    if raw.method != "POST":
        raise RequestRejected("invalid_method", f"Unsupported method {raw.method!r}; only POST", "method")
    try:
        body = decoder.decode(raw.body)
    except msgspec.ValidationError as exc:
        raise RequestRejected("invalid_request", f"Invalid request body: {exc}", "body") from exc
    return BatchInputLine(custom_id=raw.custom_id, method=raw.method, url=raw.url, body=body)
