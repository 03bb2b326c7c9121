"""Input-file validator throughput: batchgen's msgspec validator against pydantic v2 and plain ``json`` + dict checks.

Generates a 50,000-line file of realistic chat requests (with a few bad lines), runs the three validators over the
same file (same checks as far as practical: JSON, UTF-8, envelope, method, url, body types and ranges, unique
custom_ids, one model, no streaming), takes the best of a few runs and prints MB/s and ratios.

    PYTHONPATH=packages/batchgen-schemas/src python benchmarks/validator.py [--lines 50000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, TypeAdapter, ValidationError

from batchgen.schemas.validation import ValidationLimits, validate_input_file

CHAT = "/v1/chat/completions"
ROLES = ("system", "developer", "user", "assistant", "tool")

# --- the input file -------------------------------------------------------------------------------------------------

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a terse assistant. Answer in one sentence.",
    "You translate English into French. Keep the register of the original.",
    "You are a senior Python reviewer. Point out bugs first, style last.",
    "Classify the sentiment of the user's message as positive, negative or neutral.",
]
TOPICS = ["the water cycle", "binary search", "photosynthesis", "the French revolution", "TCP handshakes",
          "compound interest", "black holes", "sourdough bread", "vector clocks", "the Krebs cycle"]  # fmt: skip
ASKS = ["Explain {} to a ten-year-old.", "Write a haiku about {}.", "Give three facts about {}.",
        "What is a common misconception about {}?", "Summarise {} in two sentences, citing one source."]  # fmt: skip


def chat_request(rng: random.Random, index: int) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.8:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    for turn in range(rng.choice((1, 1, 1, 2, 3))):
        ask = rng.choice(ASKS).format(rng.choice(TOPICS))
        if rng.random() < 0.2:
            content: Any = [{"type": "text", "text": ask}, {"type": "text", "text": " Be precise. é ✓"}]
        else:
            content = ask + " " + " ".join(rng.choice(TOPICS) for _ in range(rng.randint(0, 12)))
        messages.append({"role": "user", "content": content})
        if turn and rng.random() < 0.9:
            messages.insert(-1, {"role": "assistant", "content": "Sure. " * rng.randint(1, 20)})
    body: dict[str, Any] = {"model": "demo", "messages": messages, "max_tokens": rng.choice((16, 32, 64))}
    for key, value in (("temperature", round(rng.uniform(0, 1.5), 2)), ("top_p", 0.95), ("top_k", 40),
                       ("seed", index), ("stop", ["\n\n"]), ("presence_penalty", 0.1), ("n", 1)):  # fmt: skip
        if rng.random() < 0.4:
            body[key] = value
    if rng.random() < 0.1:
        body |= {"logprobs": True, "top_logprobs": 2}
    return {"custom_id": f"request-{index}", "method": "POST", "url": CHAT, "body": body}


def bad_line(rng: random.Random, index: int) -> bytes:
    request = chat_request(rng, index)
    kind = index % 4
    if kind == 0:
        request["body"]["temperature"] = 7
    elif kind == 1:
        del request["body"]["messages"][-1]["role"]
    elif kind == 2:
        request["custom_id"] = "request-0"  # duplicate
    else:
        return json.dumps(request).encode()[:-3]  # truncated JSON
    return json.dumps(request).encode()


def write_input_file(path: str, lines: int, seed: int = 0) -> int:
    """Write the file; return how many bad lines it holds (one in 500)."""
    rng = random.Random(seed)
    bad = 0
    with open(path, "wb") as file:
        for index in range(lines):
            if index % 500 == 499:
                file.write(bad_line(rng, index) + b"\n")
                bad += 1
            else:
                file.write(json.dumps(chat_request(rng, index), ensure_ascii=False).encode() + b"\n")
    return bad


# --- the pydantic v2 validator ----------------------------------------------------------------------------------


class PTextPart(BaseModel):
    type: Literal["text"]
    text: str


class PMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[PTextPart] | None = None
    name: str | None = None


class PResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class PChatBody(BaseModel):
    model: str
    messages: Annotated[list[PMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    seed: int | None = None
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    ignore_eos: bool = False
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    stream: bool | None = None
    user: str | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    response_format: PResponseFormat | None = None


class PChatLine(BaseModel):
    custom_id: Annotated[str, Field(min_length=1)]
    method: Literal["POST"]
    url: Literal["/v1/chat/completions"]
    body: PChatBody


def pydantic_validate(path: str) -> int:
    """The pydantic way: one model for a whole chat line, plus the cross-line checks. Returns the error count."""
    adapter = TypeAdapter(PChatLine)
    errors, seen, model = 0, set(), None
    with open(path, "rb") as file:
        for line in file:
            if not line.strip():
                continue
            try:
                request = adapter.validate_json(line)
            except ValidationError:
                errors += 1
                continue
            body = request.body
            model = model or body.model
            if request.custom_id in seen or body.model != model or body.stream or (
                body.top_logprobs is not None and not body.logprobs
            ):  # fmt: skip
                errors += 1
            seen.add(request.custom_id)
    return errors


# --- the plain json + dict-check validator ------------------------------------------------------------------------

RANGES = {"temperature": (0, 2), "top_p": (0, 1), "presence_penalty": (-2, 2), "frequency_penalty": (-2, 2)}
INTS = {"max_tokens": 1, "max_completion_tokens": 1, "top_k": -1, "n": 1, "top_logprobs": 0}


def plain_body_ok(body: Any) -> bool:
    if not isinstance(body, dict) or not isinstance(body.get("model"), str):
        return False
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return False
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            return False
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):  # fmt: skip
                return False
        elif content is not None and not isinstance(content, str):
            return False
    for key, (low, high) in RANGES.items():
        value = body.get(key)
        if value is not None and (not isinstance(value, int | float) or isinstance(value, bool) or
                                  not low <= value <= high):  # fmt: skip
            return False
    for key, low in INTS.items():
        value = body.get(key)
        if value is not None and (type(value) is not int or value < low):
            return False
    stop = body.get("stop")
    return stop is None or isinstance(stop, str) or (isinstance(stop, list) and len(stop) <= 4)


def plain_validate(path: str) -> int:
    errors, seen, model = 0, set(), None
    with open(path, "rb") as file:
        for line in file:
            if not line.strip():
                continue
            try:
                request = json.loads(line)
            except ValueError:  # also UnicodeDecodeError
                errors += 1
                continue
            if (
                not isinstance(request, dict)
                or not isinstance(request.get("custom_id"), str)
                or request.get("method") != "POST"
                or request.get("url") != CHAT
                or not plain_body_ok(request.get("body"))
            ):
                errors += 1
                continue
            body, custom_id = request["body"], request["custom_id"]
            model = model or body["model"]
            if custom_id in seen or body["model"] != model or body.get("stream") or (
                body.get("top_logprobs") is not None and not body.get("logprobs")
            ):  # fmt: skip
                errors += 1
            seen.add(custom_id)
    return errors


def batchgen_validate(path: str) -> int:
    return validate_input_file(path, endpoint=CHAT, limits=ValidationLimits(max_requests=10**7)).error_count


# --- the run --------------------------------------------------------------------------------------------------------


def best_times(validators: dict[str, Callable[[str], int]], path: str, repeats: int) -> dict[str, tuple[float, int]]:
    """Best CPU time (process time, so that other load on the machine counts less) and error count of each
    validator; the runs are interleaved so that any drift in the machine's speed hits them all alike."""
    best: dict[str, tuple[float, int]] = {name: (float("inf"), -1) for name in validators}
    for _ in range(repeats):
        for name, validate in validators.items():
            start = time.process_time()
            errors = validate(path)
            best[name] = (min(best[name][0], time.process_time() - start), errors)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=50_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "requests.jsonl")
        bad = write_input_file(path, args.lines)
        size = os.path.getsize(path)
        print(f"{args.lines} chat requests ({bad} bad), {size / 1e6:.1f} MB, best of {args.repeats}\n")
        results = list(
            best_times(
                {
                    "batchgen (msgspec)": batchgen_validate,
                    "pydantic v2": pydantic_validate,
                    "json + dict checks": plain_validate,
                },
                path,
                args.repeats,
            ).items()
        )
    ours = results[0][1][0]
    print(f"| {'validator':<20} | {'seconds':>7} | {'MB/s':>7} | {'errors':>6} | {'batchgen speed-up':>17} |")
    print(f"|{'-' * 22}|{'-' * 8}:|{'-' * 8}:|{'-' * 7}:|{'-' * 18}:|")
    for name, (seconds, errors) in results:
        print(
            f"| {name:<20} | {seconds:>7.3f} | {size / 1e6 / seconds:>7.1f} | {errors:>6} | {seconds / ours:>16.1f}x |"
        )
    if len({errors for _, (_, errors) in results}) != 1 or results[0][1][1] != bad:
        raise SystemExit(f"the validators disagree on the error count (expected {bad})")


if __name__ == "__main__":
    main()
