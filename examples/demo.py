"""The main job end to end: start a server with the demo model, try one online chat call (streamed), run the example
batches through the real REST API (chat, completions, embeddings, and extraction: a JSON schema given once for the
batch, which every line without a format of its own follows), print a summary and the first results, stop the server.
Exits non-zero on failure.

    python examples/demo.py [--model demo] [--max-decoding-length 32]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from batchgen.server.launcher import CLEAN_EXIT_CODES, ServerProcess

EXAMPLES = Path(__file__).parent
PERSON = {
    "type": "json_schema",
    "json_schema": {
        "name": "person",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 16},
                "age": {"type": "integer", "minimum": 0, "maximum": 130},
            },
            "required": ["name", "age"],
            "additionalProperties": False,
        },
    },
}
"""The extraction batch's ``response_format``: the lines that set no format of their own follow it."""
BATCHES: list[tuple[str, str, dict[str, Any]]] = [
    ("chat.jsonl", "/v1/chat/completions", {}),
    ("completions.jsonl", "/v1/completions", {}),
    ("embeddings.jsonl", "/v1/embeddings", {}),
    ("extraction.jsonl", "/v1/chat/completions", {"response_format": PERSON}),
]
TERMINAL = {"completed", "failed", "expired", "cancelled"}


def run(http: httpx.Client, max_decoding_length: int, timeout_s: float) -> list[dict[str, Any]]:
    created = []
    for name, endpoint, defaults in BATCHES:
        with open(EXAMPLES / name, "rb") as f:
            upload = http.post("/v1/files", data={"purpose": "batch"}, files={"file": (name, f)})
        upload.raise_for_status()
        batch = http.post(
            "/v1/batches",
            json={
                "input_file_id": upload.json()["id"],
                "endpoint": endpoint,
                "max_decoding_length": max_decoding_length,
                "metadata": {"ds_name": f"demo {name}"},
                **defaults,
            },
        )
        batch.raise_for_status()
        created.append(batch.json())
        print(f"submitted {name:<18} -> {batch.json()['id']}")

    deadline = time.monotonic() + timeout_s
    finished: dict[str, dict[str, Any]] = {}
    while len(finished) < len(created):
        if time.monotonic() > deadline:
            raise TimeoutError(f"batches not finished after {timeout_s} s")
        for batch in created:
            if batch["id"] not in finished:
                current = http.get(f"/v1/batches/{batch['id']}").json()
                if current["status"] in TERMINAL:
                    finished[batch["id"]] = current
        time.sleep(0.2)
    return [finished[batch["id"]] for batch in created]


def try_online(http: httpx.Client, model: str) -> None:
    """One streamed chat call, answered at once by the engine that runs the batches."""
    body = {"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16, "stream": True}
    start, text = time.monotonic(), ""
    with http.stream("POST", "/v1/chat/completions", json=body) as stream:
        stream.raise_for_status()
        for line in stream.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
    print(f"online chat call, streamed: {text[:40]!r} in {time.monotonic() - start:.2f} s")


def print_summary(batches: list[dict[str, Any]]) -> None:
    header = f"{'input':<18} {'status':<10} {'total':>5} {'ok':>4} {'fail':>4} {'in tok':>7} {'out tok':>7} {'secs':>5}"
    print(f"\n{header}\n{'-' * len(header)}")
    for (name, _, _), batch in zip(BATCHES, batches, strict=True):
        counts, usage = batch["request_counts"], batch["usage"]
        seconds = (batch["completed_at"] or batch["failed_at"] or batch["created_at"]) - batch["created_at"]
        print(
            f"{name:<18} {batch['status']:<10} {counts['total']:>5} {counts['completed']:>4} {counts['failed']:>4} "
            f"{usage['input_tokens']:>7} {usage['output_tokens']:>7} {seconds:>5}"
        )


def print_first_results(http: httpx.Client, batches: list[dict[str, Any]], per_batch: int = 2) -> None:
    print("\nfirst results (the demo model has random weights: its text is noise)")
    for batch in batches:
        if batch["output_file_id"] is None:
            continue
        content = http.get(f"/v1/files/{batch['output_file_id']}/content").content
        for raw in content.splitlines()[:per_batch]:
            line = json.loads(raw)
            body = line["response"]["body"]
            if body["object"] == "chat.completion":
                shown = repr(body["choices"][0]["message"]["content"][:60])
            elif body["object"] == "text_completion":
                shown = repr(body["choices"][0]["text"][:60])
            else:
                shown = f"{len(body['data'])} embedding(s) of {len(body['data'][0]['embedding'])} dimensions"
            print(f"  {batch['endpoint']:<22} {line['custom_id']:<14} {shown}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo")
    parser.add_argument("--max-decoding-length", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="batchgen-demo-") as storage:
        print(f"starting the server with model {args.model!r} ...")
        # The example files name the model "demo": another model answers to that name too.
        aliases = () if args.model == "demo" else ("--served-model-name", args.model, "--served-model-name", "demo")
        server = ServerProcess(Path(storage), *aliases, model=args.model).start()
        try:
            with httpx.Client(base_url=server.base_url, timeout=60) as http:
                model = http.get("/v1/models").json()["data"][0]
                print(f"server up at {server.base_url}: {model['id']} (context {model['max_context_length']} tokens)")
                try_online(http, model["id"])
                batches = run(http, args.max_decoding_length, args.timeout)
                print_summary(batches)
                print_first_results(http, batches)
        finally:
            code = server.stop()
            print(f"\nserver stopped ({'cleanly' if code in CLEAN_EXIT_CODES else f'exit code {code}'})")
    failures = [b for b in batches if b["status"] != "completed" or b["request_counts"]["failed"]]
    if failures or code not in CLEAN_EXIT_CODES:
        print(f"FAILED: {len(failures)} batch(es) did not complete cleanly", file=sys.stderr)
        return 1
    print("demo OK: every example request completed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
