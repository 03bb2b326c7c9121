"""The official ``openai`` SDK, unchanged, against a real server with the demo model."""

from __future__ import annotations

import json
import time
from typing import Any

import openai
import pytest
from server_helpers import LiveServer, chat_line, jsonl


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key="unused", max_retries=0)


def _wait(client: openai.OpenAI, batch_id: str, timeout_s: float = 60) -> Any:
    deadline = time.monotonic() + timeout_s
    while (batch := client.batches.retrieve(batch_id)).status not in {"completed", "failed", "expired", "cancelled"}:
        assert time.monotonic() < deadline, batch
        time.sleep(0.05)
    return batch


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [model.id for model in models.data] == ["demo"]
    model = client.models.retrieve("demo")
    assert (model.id, model.object, model.owned_by) == ("demo", "model", "batchgen")
    assert model.model_extra == {"max_context_length": 2048, "parent": None, "root": None}  # vLLM's card: no LoRA
    with pytest.raises(openai.NotFoundError) as raised:
        client.models.retrieve("gpt-4o")
    assert raised.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_upload_run_and_download(client: openai.OpenAI) -> None:
    lines = [chat_line(f"q{i}", f"Question {i}?") for i in range(4)]
    uploaded = client.files.create(file=("questions.jsonl", jsonl(lines)), purpose="batch")
    assert uploaded.id.startswith("file-") and uploaded.object == "file"
    assert (uploaded.filename, uploaded.purpose, uploaded.bytes) == ("questions.jsonl", "batch", len(jsonl(lines)))
    assert uploaded.status == "processed"

    created = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"ds_name": "sdk test"},
        extra_body={"max_decoding_length": 5},
    )
    assert created.id.startswith("batch_") and created.status == "validating"
    batch = _wait(client, created.id)

    assert batch.status == "completed", batch
    assert (batch.endpoint, batch.model, batch.input_file_id, batch.completion_window) == (
        "/v1/chat/completions",
        "demo",
        uploaded.id,
        "24h",
    )
    assert batch.metadata == {"ds_name": "sdk test"}
    assert batch.request_counts is not None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (4, 4, 0)
    assert batch.error_file_id is None and batch.output_file_id is not None and batch.errors is None
    assert batch.created_at <= batch.in_progress_at <= batch.finalizing_at <= batch.completed_at  # type: ignore[operator]
    assert batch.expires_at == batch.created_at + 24 * 3600
    assert batch.failed_at is batch.expired_at is batch.cancelling_at is batch.cancelled_at is None
    assert batch.model_extra is not None and batch.model_extra["max_decoding_length"] == 5

    output = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(line["custom_id"] for line in output) == [f"q{i}" for i in range(4)]
    for line in output:
        assert line["id"].startswith("batch_req_") and line["error"] is None
        assert line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert body["object"] == "chat.completion" and body["model"] == "demo"
        assert body["choices"][0]["message"]["role"] == "assistant"
        assert body["choices"][0]["finish_reason"] in {"stop", "length"}
    assert batch.usage is not None
    assert batch.usage.output_tokens == sum(line["response"]["body"]["usage"]["completion_tokens"] for line in output)
    assert batch.usage.input_tokens == sum(line["response"]["body"]["usage"]["prompt_tokens"] for line in output)
    assert batch.usage.total_tokens == batch.usage.input_tokens + batch.usage.output_tokens

    output_file = client.files.retrieve(batch.output_file_id)
    assert (output_file.purpose, output_file.status) == ("batch_output", "processed")


def test_list_batches_across_pages(client: openai.OpenAI) -> None:
    file_id = client.files.create(file=("one.jsonl", jsonl([chat_line("only")])), purpose="batch").id
    created = [
        client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h").id
        for _ in range(5)
    ]
    first_page = client.batches.list(limit=2)
    assert len(first_page.data) == 2 and first_page.has_more
    assert [b.id for b in first_page.data] == created[::-1][:2]  # newest first
    listed = [batch.id for batch in client.batches.list(limit=2)]  # the SDK follows `after` through every page
    assert [batch_id for batch_id in listed if batch_id in created] == created[::-1]
    assert len(listed) == len(set(listed))
    for batch_id in created:
        assert _wait(client, batch_id).status == "completed"


def test_files_list_and_delete(client: openai.OpenAI) -> None:
    ids = [client.files.create(file=(f"f{i}.jsonl", jsonl([chat_line("x")])), purpose="batch").id for i in range(3)]
    listed = [file.id for file in client.files.list(purpose="batch")]
    assert [file_id for file_id in listed if file_id in ids] == ids[::-1]  # default order: newest first
    ascending = [file.id for file in client.files.list(purpose="batch", order="asc")]
    assert [file_id for file_id in ascending if file_id in ids] == ids
    paged = client.files.list(purpose="batch", limit=1, after=ids[2])
    assert [file.id for file in paged.data] == [ids[1]]

    deleted = client.files.delete(ids[0])
    assert (deleted.id, deleted.deleted, deleted.object) == (ids[0], True, "file")
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(ids[0])
    with pytest.raises(openai.NotFoundError):
        client.files.content(ids[0])
    assert ids[0] not in [file.id for file in client.files.list(purpose="batch")]


def test_cancel(client: openai.OpenAI) -> None:
    lines = [chat_line(f"long{i}", max_tokens=1500, ignore_eos=True) for i in range(6)]
    file_id = client.files.create(file=("long.jsonl", jsonl(lines)), purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in {"cancelling", "cancelled"} and cancelling.cancelling_at is not None
    cancelled = _wait(client, batch.id, timeout_s=20)
    assert cancelled.status == "cancelled" and cancelled.cancelled_at is not None
    assert cancelled.completed_at is None
    assert cancelled.request_counts is not None and cancelled.request_counts.completed < 6
    again = client.batches.cancel(batch.id)
    assert again.model_dump() == cancelled.model_dump()
