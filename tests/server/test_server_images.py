"""Images through the real API on a tiny Qwen2.5-VL-shaped model: a batch whose lines carry a data URL, name an
uploaded image by file id (one upload, many lines) or break a limit (an error line each); an online request streamed
through the openai SDK, unchanged; the Responses API's ``input_image``; every bad part a 400 naming it; a text-only
model refusing image parts. Greedy outputs are transformers' ``generate`` on the same picture."""

from __future__ import annotations

import base64
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from server_helpers import LiveServer
from transformers import AutoModelForImageTextToText
from vlm_helpers import data_url, hf_greedy, image, png_bytes, qwen2_5_vl

from batchgen.server.serving.image_processor import ImageProcessor

PROMPT = "what is it?"
PICTURES = [image(60, 60, 3), image(70, 50, 1)]


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"))


@pytest.fixture(scope="module")
def server(server_factory: Callable[..., LiveServer], vlm_path: Path) -> LiveServer:
    return server_factory(
        "--model",
        str(vlm_path),
        "--served-model-name",
        "m",
        "--limit-mm-per-prompt",
        '{"image": 2}',
        "--max-image-pixels",
        "1000000",
    )


@pytest.fixture(scope="module")
def expected(vlm_path: Path) -> Callable[[int], str]:
    """The text ``generate`` gives for picture ``i`` and the prompt (4 greedy tokens)."""
    model = AutoModelForImageTextToText.from_pretrained(vlm_path, dtype=torch.float32).eval()
    processor = ImageProcessor(str(vlm_path), None).processor
    done: dict[int, str] = {}

    def text(i: int) -> str:
        if i not in done:
            messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
            tokens, _, _ = hf_greedy(model, processor, messages, [PICTURES[i]], 4)
            done[i] = processor.tokenizer.decode(tokens, skip_special_tokens=True)
        return done[i]

    return text


def _chat(part: dict[str, Any], **body: Any) -> dict[str, Any]:
    content = [part, {"type": "text", "text": PROMPT}]
    return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 4, **body}


def _image_url(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def _upload_image(server: LiveServer, data: bytes, purpose: str = "vision") -> dict[str, Any]:
    response = server.http.post("/v1/files", data={"purpose": purpose}, files={"file": ("p.png", data)})
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def _bomb() -> bytes:
    """A few hundred bytes of PNG whose header claims 100,000 x 100,000 pixels."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    )


def test_image_batch(server: LiveServer, expected: Callable[[int], str]) -> None:
    """One upload named by many lines, data URLs, and bad lines that become error lines."""
    file_id = _upload_image(server, png_bytes(PICTURES[0]))["id"]
    bodies = {
        "data-0": _chat(_image_url(data_url(PICTURES[0]))),
        "data-1": _chat(_image_url(data_url(PICTURES[1], "JPEG"))),
        "file-a": _chat({"type": "file", "file": {"file_id": file_id}}),
        "file-b": _chat({"type": "file", "file": {"file_id": file_id}}, temperature=0),
        "bad-base64": _chat(_image_url("data:image/png;base64,iVBOR!!")),
        "bomb": _chat(_image_url("data:image/png;base64," + base64.b64encode(_bomb()).decode())),
        "no-file": _chat({"type": "file", "file": {"file_id": "file-0123"}}),
    }
    lines = [{"custom_id": k, "method": "POST", "url": "/v1/chat/completions", "body": b} for k, b in bodies.items()]
    batch = server.run(lines)
    assert batch["status"] == "completed", batch
    out = {line["custom_id"]: line for line in server.lines(batch["output_file_id"])}
    text = {k: line["response"]["body"]["choices"][0]["message"]["content"] for k, line in out.items()}
    assert text["data-0"] == text["file-a"] == text["file-b"] == expected(0)
    errors = {line["custom_id"]: line["response"]["body"]["error"] for line in server.lines(batch["error_file_id"])}
    assert set(errors) == {"bad-base64", "bomb", "no-file"}
    assert errors["bad-base64"]["code"] == "invalid_image"
    assert errors["bomb"]["code"] == "image_too_large" and "100000 x 100000" in errors["bomb"]["message"]
    assert errors["no-file"]["code"] == "file_not_found"
    assert out["data-1"]["response"]["body"]["usage"]["prompt_tokens"] > 0


def test_online_stream_through_the_openai_sdk(server: LiveServer, expected: Callable[[int], str]) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    stream = client.chat.completions.create(
        model="m",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_url(PICTURES[1]), "detail": "low"}},
                    {"type": "text", "text": PROMPT},
                ],
            }
        ],
        max_tokens=4,
        temperature=0,
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == expected(1)


def test_responses_input_image_by_file_id(server: LiveServer, expected: Callable[[int], str]) -> None:
    file_id = _upload_image(server, png_bytes(PICTURES[0], "WEBP"), purpose="user_data")["id"]
    body = {
        "model": "m",
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "file_id": file_id},
                    {"type": "input_text", "text": PROMPT},
                ],
            }
        ],
        "max_output_tokens": 4,
    }
    response = server.http.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["output"][0]["content"][0]["text"]  # WebP decodes (other pixels than the PNG's, lossy)


def test_responses_image_errors_name_the_input_item(server: LiveServer) -> None:
    """A bad ``input_image`` is named where the response request has it (it was ``input``), past ``instructions``;
    one in an assistant's message is refused (it was taken)."""
    bad = {"type": "input_image", "image_url": "data:image/png;base64,@@@@"}
    user = {"role": "user", "content": [{"type": "input_text", "text": PROMPT}, bad]}
    body = {"model": "m", "instructions": "Be brief.", "input": [user], "max_output_tokens": 4}
    error = server.http.post("/v1/responses", json=body).json()["error"]
    assert (error["code"], error["param"]) == ("invalid_image", "input[0].content[1].image_url")
    good = {"type": "input_image", "image_url": data_url(PICTURES[0])}
    spoken = {"role": "assistant", "content": [{"type": "output_text", "text": "a cat"}, good]}
    body["input"] = [{"role": "user", "content": PROMPT}, spoken, {"role": "user", "content": PROMPT}]
    response = server.http.post("/v1/responses", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "input[1].content[1]"
    assert "user message" in response.json()["error"]["message"]
    chat = _chat(_image_url(data_url(PICTURES[0])))
    chat["messages"] = [{"role": "system", "content": chat["messages"][0]["content"]}, *chat["messages"]]
    refused = server.http.post("/v1/chat/completions", json=chat)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages[0].content[0]"


@pytest.mark.parametrize(
    ("part", "param", "code"),
    [
        (_image_url("https://example.com/cat.png"), "messages[0].content[0].image_url.url", "invalid_image_url"),
        (_image_url("data:image/png;base64,@@@@"), "messages[0].content[0].image_url.url", "invalid_image"),
        (_image_url("data:text/plain;base64,aGk="), "messages[0].content[0].image_url.url", "invalid_image_url"),
        (_image_url("data:image/png;base64," + base64.b64encode(b"not an image").decode()), None, "invalid_image"),
    ],
)
def test_bad_parts_are_400s_naming_them(server: LiveServer, part: dict[str, Any], param: str | None, code: str) -> None:
    response = server.http.post("/v1/chat/completions", json=_chat(part))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == code
    assert error["param"] == (param or "messages[0].content[0].image_url.url")


def test_limits(server: LiveServer) -> None:
    url = _image_url(data_url(PICTURES[0]))
    body = _chat(url)
    body["messages"][0]["content"] = [url, url, url, {"type": "text", "text": "three"}]
    response = server.http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages[0].content[2]"
    gif = _chat(_image_url(data_url(PICTURES[0], "GIF")), response_format={"type": "json_object"})  # its first frame
    answer = server.http.post("/v1/chat/completions", json=gif)  # structured outputs with an image in the prompt
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"].startswith("{")
    bomb = server.http.post("/v1/files", data={"purpose": "vision"}, files={"file": ("b.png", _bomb())})
    assert bomb.status_code == 422 and bomb.json()["error"]["code"] == "image_too_large"  # as a bad input file


def test_text_only_model_refuses_images(live_server: LiveServer) -> None:
    body = _chat(_image_url(data_url(PICTURES[0])))
    body["model"] = "demo"
    response = live_server.http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "unsupported_content"
    assert response.json()["error"]["param"] == "messages[0].content[0]"


def test_client_and_cli_build_an_image_batch_from_a_folder(
    server: LiveServer, expected: Callable[[int], str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A folder of pictures and one prompt: each distinct picture uploaded once, one line per file."""
    import json

    from batchgen.client import BatchGenHttpClient
    from batchgen.client.cli import main

    folder = tmp_path / "pictures"
    folder.mkdir()
    for name, i in (("a.png", 0), ("b.png", 1), ("same-as-a.png", 0)):
        (folder / name).write_bytes(png_bytes(PICTURES[i]))
    (folder / "notes.txt").write_text("not a picture")
    with BatchGenHttpClient(server.base_url) as client:
        before = {f.id for f in client.list_files(purpose="vision")}
        batch = client.submit_image_batch(folder, PROMPT, model="m", max_tokens=4, poll_interval=0.05)
        uploaded = [f for f in client.list_files(purpose="vision") if f.id not in before]
        results = {line.custom_id: line for line in client.iter_results(batch)}
    assert batch.status == "completed" and len(uploaded) == 2
    assert sorted(results) == ["a.png", "b.png", "same-as-a.png"]
    texts = {k: line.response.body.choices[0].message.content for k, line in results.items()}  # type: ignore[union-attr]
    assert texts == {"a.png": expected(0), "b.png": expected(1), "same-as-a.png": expected(0)}

    output = tmp_path / "out.jsonl"
    argv = ["images", str(folder), "--prompt", PROMPT, "--model", "m", "--max-tokens", "4", "-o", str(output)]
    assert main([*argv, "--base-url", server.base_url, "--poll-interval", "0.05", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["request_counts"]["completed"] == 3
    assert len(output.read_text().splitlines()) == 3
