# Generated from _async.py by scripts/generate_sync_client.py: do not edit.
"""The client's I/O (every decision is in ``_core``).

``_async.py`` is the source: ``_sync.py`` is generated from it by ``scripts/generate_sync_client.py``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import httpx
from tqdm.auto import tqdm

from batchgen.schemas import (
    BatchList,
    BatchObject,
    BatchOutputLine,
    FileDeleted,
    FileList,
    FileObject,
    GenerationDefaults,
    HealthStatus,
    Metadata,
    ModelList,
    ModelObject,
    PoolStatus,
)

from . import _core, _images
from ._core import (
    DEFAULT_MAX_RETRIES,
    DEFAULT_TIMEOUT_S,
    ApiRequest,
    ClientCore,
    FileInput,
    RequestsInput,
    ResponseFormatInput,
    Sleep,
    as_response_format,
)
from ._wait import BatchCallback, BatchWaiter
from .progress import progress_wanted

T = TypeVar("T")
PageT = TypeVar("PageT", FileList, BatchList)


class BatchGenHttpClient:
    """Client of the batchgen REST API (OpenAI Batch API compatible); the sync and async clients are the same.

    ``base_url`` defaults to ``$BATCHGEN_BASE_URL`` or ``http://localhost:10900``; ``api_key`` to
    ``$BATCHGEN_API_KEY`` (sent as a Bearer token). ``timeout_s=None`` waits forever. Failed requests are retried
    ``max_retries`` times (connection errors, 408, 429, 5xx). A passed ``http_client`` is used as is and left open.
    """

    def __init__(
        self,
        base_url: str | None = None,
        *,
        api_key: str | None = None,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        max_retries: int = DEFAULT_MAX_RETRIES,
        http_client: httpx.Client | None = None,
        sleep: Sleep = time.sleep,
    ) -> None:
        self._core = ClientCore(base_url, api_key, timeout_s, max_retries)
        self._owns_http = http_client is None
        self._http = http_client or httpx.Client()
        self._sleep = sleep

    @property
    def base_url(self) -> str:
        return self._core.base_url

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> BatchGenHttpClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- I/O ------------------------------------------------------------------------------------------------------

    def _request(self, request: ApiRequest[T]) -> T:
        attempt = 0
        while True:
            try:
                with self._core.build(request) as kwargs:
                    response = self._http.send(self._http.build_request(**kwargs), stream=request.stream)
            except httpx.TransportError as exc:
                if (delay := self._core.retry_delay(request, attempt, None)) is None:
                    raise _core.connection_error(exc) from exc
            else:
                if (delay := self._core.retry_delay(request, attempt, response)) is None:
                    if request.stream and not response.is_success:
                        response.read()
                    return self._core.finish(request, response)
                response.close()
            self._sleep(delay)
            attempt += 1

    def _paginate(self, request: ApiRequest[PageT] | None) -> Iterator[Any]:
        while request is not None:
            page = self._request(request)
            yield from page.data
            request = _core.next_page(request, page)

    # -- models and health ----------------------------------------------------------------------------------------

    def health_check(self) -> HealthStatus:
        """``GET /health``: ``status`` is ``"unhealthy"`` (with a ``reason``) when the server answers 503."""
        return self._request(self._core.health_check())

    def list_models(self) -> ModelList:
        return self._request(self._core.list_models())

    def get_model(self, model_id: str) -> ModelObject:
        return self._request(self._core.get_model(model_id))

    def pool_status(self) -> PoolStatus:
        return self._request(self._core.pool_status())

    # -- files ----------------------------------------------------------------------------------------------------

    def upload_file(self, file: FileInput, *, purpose: str = "batch", filename: str | None = None) -> FileObject:
        """Upload a path, bytes or a binary file object (streamed from disk, not read into memory)."""
        return self._request(self._core.upload_file(file, purpose, filename))

    def get_file(self, file_id: str) -> FileObject:
        return self._request(self._core.get_file(file_id))

    def list_files(
        self, *, purpose: str | None = None, order: str = "desc", page_size: int = 1000
    ) -> Iterator[FileObject]:
        """Every file, following the pagination cursor page by page (lazily)."""
        return self._paginate(self._core.list_files(purpose, order, page_size))

    def delete_file(self, file_id: str) -> FileDeleted:
        return self._request(self._core.delete_file(file_id))

    def download_file_content(self, file_id: str) -> bytes:
        response = self._request(self._core.file_content(file_id, stream=False))
        return response.content

    def download_file(self, file_id: str, path: str | os.PathLike[str]) -> Path:
        """Stream a file's content to ``path`` (written atomically) and return the path."""
        response = self._request(self._core.file_content(file_id, stream=True))
        try:
            with _core.atomic_write(path) as out:
                for chunk in response.iter_bytes():
                    out.write(chunk)
        finally:
            response.close()
        return Path(path)

    # -- batches --------------------------------------------------------------------------------------------------

    def create_batch(
        self,
        input_file_id: str,
        *,
        endpoint: str = "/v1/chat/completions",
        completion_window: str = "24h",
        metadata: Metadata | None = None,
        max_decoding_length: int | None = None,
        max_context_length: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        response_format: ResponseFormatInput | None = None,
        output_expires_after_s: int | None = None,
    ) -> BatchObject:
        """Start a batch; the batch-level ``GenerationDefaults`` apply to requests that do not set their own.
        ``response_format`` takes a request's ``response_format`` (a dict or a ``ResponseFormat``), or a pydantic
        model class: every line's output then follows its JSON schema. ``output_expires_after_s``: the output and
        error files are deleted that long after they are created (3600 to 2592000)."""
        defaults = GenerationDefaults(
            max_decoding_length=max_decoding_length,
            max_context_length=max_context_length,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            response_format=as_response_format(response_format),
        )
        return self._request(
            self._core.create_batch(
                input_file_id,
                endpoint=endpoint,
                completion_window=completion_window,
                metadata=metadata,
                defaults=defaults,
                output_expires_after_s=output_expires_after_s,
            )
        )

    def get_batch(self, batch_id: str) -> BatchObject:
        return self._request(self._core.get_batch(batch_id))

    def list_batches(self, *, page_size: int = 100) -> Iterator[BatchObject]:
        """Every batch, newest first, following the pagination cursor page by page (lazily)."""
        return self._paginate(self._core.list_batches(page_size))

    def cancel_batch(self, batch_id: str) -> BatchObject:
        return self._request(self._core.cancel_batch(batch_id))

    def wait_for_batch(
        self,
        batch_id: str,
        *,
        poll_interval: float = 5.0,
        timeout: float | None = None,
        progress: bool | None = None,
        callback: BatchCallback | None = None,
    ) -> BatchObject:
        """Poll until the batch completes and return it.

        Raises ``BatchFailedError``/``BatchCancelledError``/``BatchExpiredError`` for the other terminal states and
        ``BatchWaitTimeoutError`` after ``timeout`` seconds. ``progress=None`` shows a bar on a terminal only;
        ``callback`` receives every polled batch object.
        """
        waiter = BatchWaiter(
            batch_id, poll_interval=poll_interval, timeout=timeout, progress=progress, callback=callback
        )
        try:
            while True:
                batch = self.get_batch(batch_id)
                if (delay := waiter.observe(batch)) is None:
                    return batch
                self._sleep(delay)
        finally:
            waiter.close()

    def submit_batch(
        self,
        requests: RequestsInput,
        output_path: str | os.PathLike[str] | None = None,
        *,
        endpoint: str = "/v1/chat/completions",
        completion_window: str = "24h",
        metadata: Metadata | None = None,
        max_decoding_length: int | None = None,
        max_context_length: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        response_format: ResponseFormatInput | None = None,
        output_expires_after_s: int | None = None,
        wait: bool = True,
        poll_interval: float = 5.0,
        timeout: float | None = None,
        progress: bool | None = None,
        callback: BatchCallback | None = None,
    ) -> BatchObject:
        """Upload the input, create the batch and (with ``wait``) wait for it and download its output.

        ``requests`` is a path, bytes or file object of JSONL input lines, or a list of input lines or of bare
        request bodies (given ``custom_id`` ``request-<index>``).
        """
        uploaded = self.upload_file(_core.batch_input(requests, endpoint))
        batch = self.create_batch(
            uploaded.id,
            endpoint=endpoint,
            completion_window=completion_window,
            metadata=metadata,
            max_decoding_length=max_decoding_length,
            max_context_length=max_context_length,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            response_format=response_format,
            output_expires_after_s=output_expires_after_s,
        )
        if not wait:
            return batch
        batch = self.wait_for_batch(
            batch.id, poll_interval=poll_interval, timeout=timeout, progress=progress, callback=callback
        )
        if output_path is not None and batch.output_file_id is not None:
            self.download_file(batch.output_file_id, output_path)
        return batch

    def submit_image_batch(
        self,
        folder: str | os.PathLike[str],
        prompt: str,
        *,
        model: str,
        max_tokens: int | None = None,
        output_path: str | os.PathLike[str] | None = None,
        progress: bool | None = None,
        **batch: Any,
    ) -> BatchObject:
        """A batch of one chat line per image in ``folder`` (PNG, JPEG, WebP, GIF), each asking ``prompt`` about
        its picture: every distinct image uploaded once (purpose ``vision``, a bar of the uploads where ``progress``
        says), the lines naming them by file id, ``custom_id`` the file's name. ``batch``: ``submit_batch``'s
        arguments (``wait``, ``temperature``, ``metadata``...)."""
        images = _images.folder_images(folder)
        uploads = _images.distinct(images)
        bar = tqdm(total=len(uploads), desc="uploading images", unit="img", disable=not progress_wanted(progress))
        by_hash: dict[str, str] = {}
        try:
            for digest, path in uploads.items():
                by_hash[digest] = (self.upload_file(path, purpose="vision")).id
                bar.update(1)
        finally:
            bar.close()
        file_ids = {path: by_hash[digest] for path, digest in _images.hashed(images).items()}
        body = {} if max_tokens is None else {"max_tokens": max_tokens}
        lines = _images.image_lines(images, file_ids, prompt, model, body)
        return self.submit_batch(lines, output_path, progress=progress, **batch)

    def iter_results(self, batch: str | BatchObject, *, in_input_order: bool = False) -> Iterator[BatchOutputLine]:
        """The typed lines of a finished batch's output and error files (successes first unless ``in_input_order``)."""
        if isinstance(batch, str):
            batch = self.get_batch(batch)
        contents = [
            self.download_file_content(file_id) for file_id in (batch.output_file_id, batch.error_file_id) if file_id
        ]
        input_content = self.download_file_content(batch.input_file_id) if in_input_order else None
        yield from _core.parse_results(contents, input_content)
