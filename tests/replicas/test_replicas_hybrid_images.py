"""Two replicas of a tiny Qwen3.5 vision-language model on the session's Ray: Gated DeltaNet state layers beside full
attention (each replica's own state cache) and pictures through the vision tower. A batch of image lines, one picture
uploaded once and named by file id from half of them, is spread over both replicas, each line answered once with
transformers' ``generate`` text; a streamed online request gets the same."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from server_helpers import LiveServer, ServerProcess, assert_exactly_once
from transformers import AutoModelForImageTextToText
from vlm_helpers import data_url, hf_greedy, image, png_bytes, qwen3_5

from batchgen.server.serving.image_processor import ImageProcessor

PICTURES = [image(60, 60, 3), image(70, 50, 1)]
TOKENS = 4


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return qwen3_5(tmp_path_factory.mktemp("qwen3_5_vl"))


@pytest.fixture(scope="module")
def server(
    replica_flags: tuple[str, ...], vlm_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    model = ("--model", str(vlm_path), "--served-model-name", "m")
    with ServerProcess(tmp_path_factory.mktemp("replicas-vlm"), *replica_flags, *model) as process:
        server = LiveServer(process)
        yield server
        server.http.close()


def _content(i: int, picture: dict[str, Any]) -> list[dict[str, Any]]:
    """Texts that differ in the first block, so that prefix affinity does not pin the lines to one replica."""
    return [{"type": "text", "text": f"{i} {'x' * (i % 3)} look:"}, picture, {"type": "text", "text": "what is it?"}]


def test_image_lines_are_spread_over_both_replicas_and_equal_generate(server: LiveServer, vlm_path: Path) -> None:
    upload = server.http.post(
        "/v1/files", data={"purpose": "vision"}, files={"file": ("p.png", png_bytes(PICTURES[0]))}
    )
    assert upload.status_code == 200, upload.text
    parts = [
        {"type": "file", "file": {"file_id": upload.json()["id"]}},
        {"type": "image_url", "image_url": {"url": data_url(PICTURES[1])}},
    ]
    lines = [
        {
            "custom_id": f"image-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "m",
                "messages": [{"role": "user", "content": _content(i, parts[i % 2])}],
                "max_tokens": TOKENS,
                "ignore_eos": True,
            },
        }
        for i in range(8)
    ]
    before = [r["served_requests"] for r in server.http.get("/v1/pool/status").json()["replicas"]]
    batch = server.run(lines)
    assert_exactly_once(server, batch, lines)
    shares = [
        r["served_requests"] - b
        for r, b in zip(server.http.get("/v1/pool/status").json()["replicas"], before, strict=True)
    ]
    assert sum(shares) == len(lines) and min(shares) >= 1, shares

    model = AutoModelForImageTextToText.from_pretrained(vlm_path, dtype=torch.float32).eval()
    processor = ImageProcessor(str(vlm_path), None).processor

    def expected(i: int) -> str:
        content = [{"type": "image"} if part["type"] != "text" else part for part in _content(i, parts[i % 2])]
        tokens, _, _ = hf_greedy(model, processor, [{"role": "user", "content": content}], [PICTURES[i % 2]], TOKENS)
        return str(processor.tokenizer.decode(tokens, skip_special_tokens=True))

    texts = {
        line["custom_id"]: line["response"]["body"]["choices"][0]["message"]["content"]
        for line in server.lines(batch["output_file_id"])
    }
    assert texts == {f"image-{i}": expected(i) for i in range(8)}

    body = {**lines[1]["body"], "stream": True}
    with server.http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]) == expected(1)
