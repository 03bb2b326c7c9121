"""Drop-in replacement for the original ``batchgen.batchgen_client`` module.

Same class name, signatures and plain-dict results, as a thin adapter over ``batchgen.client.BatchGenHttpClient``.
Errors keep their original types: every client error is a ``RuntimeError``; ``wait_for_batch`` raises a
``RuntimeError`` subclass when the batch failed, was cancelled (or expired) and a ``TimeoutError`` subclass on
timeout. New code should use ``batchgen.client`` directly (typed results, async, pagination, progress).
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

import msgspec

from batchgen.client import BatchGenError
from batchgen.client import BatchGenHttpClient as _TypedClient

__all__ = ["BatchGenHttpClient"]


def _plain(obj: msgspec.Struct) -> dict[str, Any]:
    result: dict[str, Any] = msgspec.to_builtins(obj)
    return result


class BatchGenHttpClient:
    """HTTP client for the BatchGen OpenAI-compatible API, returning plain dicts."""

    def __init__(self, base_url: str, timeout_s: float | None = None) -> None:
        # The original retried 429 five times; the typed client also retries connection errors and 5xx.
        self._client = _TypedClient(base_url, timeout_s=timeout_s, max_retries=5)

    def health_check(self) -> bool:
        try:
            return self._client.health_check().status == "healthy"
        except BatchGenError:
            return False

    def upload_file(self, file_path: str, purpose: str = "batch") -> dict[str, Any]:
        return _plain(self._client.upload_file(file_path, purpose=purpose))

    def get_file(self, file_id: str) -> dict[str, Any]:
        return _plain(self._client.get_file(file_id))

    def download_file_content(self, file_id: str) -> bytes:
        return self._client.download_file_content(file_id)

    def create_batch(
        self,
        input_file_id: str,
        endpoint: str = "/v1/chat/completions",
        completion_window: str = "24h",
        metadata: dict[str, str] | None = None,
        max_decoding_length: int | None = None,
        max_context_length: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
    ) -> dict[str, Any]:
        batch = self._client.create_batch(
            input_file_id,
            endpoint=endpoint,
            completion_window=completion_window,
            metadata=metadata or None,
            max_decoding_length=max_decoding_length,
            max_context_length=max_context_length,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
        )
        return _plain(batch)

    def get_batch(self, batch_id: str) -> dict[str, Any]:
        return _plain(self._client.get_batch(batch_id))

    def wait_for_batch(self, batch_id: str, poll_interval: float = 5.0, timeout: float | None = None) -> dict[str, Any]:
        # The original treated timeout=0 as no timeout.
        return _plain(self._client.wait_for_batch(batch_id, poll_interval=poll_interval, timeout=timeout or None))

    def submit_batch(
        self,
        input_file_path: str,
        output_file_path: str | None = None,
        endpoint: str = "/v1/chat/completions",
        poll_interval: float = 5.0,
        timeout: float | None = None,
        max_decoding_length: int | None = None,
        max_context_length: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
    ) -> dict[str, Any]:
        batch = self._client.submit_batch(
            input_file_path,
            output_file_path,
            endpoint=endpoint,
            poll_interval=poll_interval,
            timeout=timeout or None,
            max_decoding_length=max_decoding_length,
            max_context_length=max_context_length,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
        )
        return _plain(batch)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> BatchGenHttpClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
