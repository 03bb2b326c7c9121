"""Image lines through a tiny Qwen2.5-VL-shaped model: images/s and output tokens per CPU second, the encoder cache
on and off, against transformers' ``generate`` one image at a time and vLLM's CPU build on the same directory.

    python benchmarks/images.py            # 1,000 lines: 200 distinct images x 5 prompts
    python benchmarks/images.py --quick    # 200 lines: 40 images x 5 prompts
    python benchmarks/images.py --online   # also: the same batch through a server, TTFT of online image requests

Each line is a chat (the prompt's text, then the picture as a data URL) made ready by the serving layer (base64
decoded, Pillow, the processor: counted in the engine's time) and run greedily for ``--tokens`` tokens, ignore_eos.
The text comes before the picture, so the prefix cache cannot stand in for the encoder cache (the same picture after
another prompt). The engine's outputs are checked token for token against ``generate`` on the lines it runs. The
encoder cache also runs under a budget smaller than the batch's pictures (its memory: the bytes it counts and the
storage its entries hold).

``--online`` starts ``batchgen-server serve`` on the model, uploads the pictures once (purpose ``vision``), submits
the lines as a batch naming them by file id, and streams online image requests (each a picture the batch does not
hold, so its vision step runs on arrival) one after another, first with the server idle, then while the batch runs:
time to the first token, p50 / p95, and the load average (the machine is shared).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # vlm_helpers: the tiny model, pictures

from transformers import AutoModelForImageTextToText
from vlm_helpers import data_url, hf_greedy, image, png_bytes, qwen2_5_vl

from batchgen.schemas import ChatCompletionRequest
from batchgen.server.engine import EngineConfig, LLMEngine
from batchgen.server.serving import BatchDefaults, OpenAIServing
from batchgen.server.serving.config import ServingConfig
from batchgen.server.serving.image_processor import ImageProcessor
from batchgen.server.serving.images import media_of

PROMPTS = ["Describe it.", "What colour dominates?", "Count the shapes.", "Is it a photo?", "Caption it briefly."]
VLLM_PYTHON = Path("/work/vllm-venv/bin/python")


def pictures(count: int) -> list[Any]:
    """Distinct random pictures of a few sizes (4 to 16 image tokens each)."""
    sizes = [(56, 56), (84, 56), (112, 84), (56, 112)]
    return [image(*sizes[i % len(sizes)], seed=1000 + i) for i in range(count)]


def bodies(images: list[Any]) -> list[tuple[int, str, ChatCompletionRequest]]:
    import msgspec

    lines = []
    urls = [data_url(picture) for picture in images]
    for prompt in PROMPTS:  # prompt by prompt: a picture comes back after every other picture
        for i, url in enumerate(urls):
            content = [{"type": "text", "text": prompt + " "}, {"type": "image_url", "image_url": {"url": url}}]
            body = {"model": "m", "messages": [{"role": "user", "content": content}]}
            lines.append((i, prompt, msgspec.convert(body, ChatCompletionRequest)))
    return lines


def run_engine(path: Path, lines: list[Any], tokens: int, cache_mib: float) -> dict[str, Any]:
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    processor = ImageProcessor(str(path), None)
    tokenizer = processor.processor.tokenizer
    config = EngineConfig(
        model=str(path), dtype="float32", device="cpu", encoder_cache_mib=1 if cache_mib else 0, max_num_seqs=64
    )
    engine = LLMEngine(model, tokenizer, config, "m")
    assert engine.runner.vision is not None
    engine.runner.vision.cache.budget = int(cache_mib * 2**20)  # finer than the flag's MiB: a budget below the
    # batch's pictures here
    serving = OpenAIServing(tokenizer, ("m",), 4096, len(tokenizer), images=media_of(ServingConfig(), processor))
    defaults = BatchDefaults(max_decoding_length=tokens, temperature=0.0)
    cache = engine.runner.vision.cache
    outputs: dict[str, list[int]] = {}
    most_held = 0

    def step() -> None:
        nonlocal most_held
        outputs.update((r.request_id, r.outputs[0].token_ids) for r in engine.step() if r.finished)
        most_held = max(most_held, cache.held_bytes())  # the cache's memory after every step, not just the last

    wall, cpu = time.perf_counter(), time.process_time()
    ids: list[str] = []
    for n, (_, _, body) in enumerate(lines):
        for request in serving.prepare(body, request_id=f"r{n}", defaults=defaults).requests:
            request.params = dataclasses.replace(request.params, ignore_eos=True)
            engine.add_request(request)
            ids.append(request.request_id)
        while engine.has_unfinished_requests() and len(engine.scheduler.waiting) > 64:
            step()
    while engine.has_unfinished_requests():
        step()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    vision = engine.runner.vision
    assert vision is not None
    return {
        "wall": wall, "cpu": cpu, "tokens": sum(map(len, outputs.values())), "lines": len(lines),
        "encoded": vision.encoded_images, "cache_bytes": vision.cache.bytes, "cached_images": len(vision.cache),
        "held_bytes": vision.cache.held_bytes(), "most_held": most_held, "budget": vision.cache.budget,
        "outputs": [outputs[i] for i in ids],
    }  # fmt: skip


def run_hf(path: Path, images: list[Any], lines: list[Any], tokens: int, count: int) -> dict[str, Any]:
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    processor = ImageProcessor(str(path), None).processor
    wall, cpu = time.perf_counter(), time.process_time()
    outputs = []
    for i, prompt, _ in lines[:count]:
        messages = [{"role": "user", "content": [{"type": "text", "text": prompt + " "}, {"type": "image"}]}]
        outputs.append(hf_greedy(model, processor, messages, [images[i]], tokens)[0])
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"wall": wall, "cpu": cpu, "tokens": sum(map(len, outputs)), "lines": count, "outputs": outputs}


def run_vllm(path: Path, images: list[Any], lines: list[Any], tokens: int) -> dict[str, Any] | str:
    """vLLM's row, or why it has none (its own words, one line)."""
    if not VLLM_PYTHON.exists():
        return "no vLLM build at /work/vllm-venv"
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for i, picture in enumerate(images):
            picture.save(folder / f"{i}.png")
        (folder / "lines.json").write_text(json.dumps([[i, prompt] for i, prompt, _ in lines]))
        command = [str(VLLM_PYTHON), str(Path(__file__).with_name("vllm_images_peer.py")), str(path), str(folder)]
        command += ["--tokens", str(tokens)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env.pop("PYTHONPATH", None)
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            said = (done.stdout + done.stderr).splitlines()
            # The root cause where vLLM logs one (an import its model registry failed on), else its last error.
            errors = [s for s in said if "ModuleNotFoundError" in s] or [s for s in said if "Error" in s]
            return (errors[-1] if errors else said[-1]).split("]")[-1].strip()[:300]
        return dict(json.loads((folder / "out.json").read_text()))


def streamed_ttft(http: Any, picture: Any, tokens: int) -> float:
    """Seconds to the first token of a streamed online chat about ``picture``."""
    url = data_url(picture)
    content = [{"type": "text", "text": PROMPTS[0] + " "}, {"type": "image_url", "image_url": {"url": url}}]
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": tokens, "stream": True}
    start = time.perf_counter()
    with http.stream("POST", "/v1/chat/completions", json={**body, "ignore_eos": True}) as stream:
        stream.raise_for_status()
        for line in stream.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                return time.perf_counter() - start
    raise AssertionError("no token streamed")


def run_online(path: Path, images: list[Any], lines: list[Any], tokens: int, calls: int) -> dict[str, Any]:
    """The lines as a batch through a server (pictures uploaded once), and streamed online image requests' time to
    the first token with the server idle and while the batch runs."""
    import httpx

    from batchgen.server.launcher import ServerProcess

    probes = iter(image(84, 56, seed=5000 + i) for i in range(10 * calls))  # never in the batch: encoded on arrival
    flags = ["--served-model-name", "m", "--dtype", "float32", "--torch-threads", "1", "--max-num-seqs", "64"]
    with tempfile.TemporaryDirectory() as tmp, ServerProcess(Path(tmp), *flags, model=str(path)) as server:
        http = httpx.Client(base_url=server.base_url, timeout=600)
        file_ids = []
        for picture in images:
            data = png_bytes(picture)
            uploaded = http.post("/v1/files", data={"purpose": "vision"}, files={"file": ("p.png", data)})
            file_ids.append(uploaded.json()["id"])
        for _ in range(3):  # warm up
            streamed_ttft(http, next(probes), tokens)
        load_idle = os.getloadavg()[0]
        idle = [streamed_ttft(http, next(probes), tokens) for _ in range(calls)]
        content = "".join(
            json.dumps({
                "custom_id": f"l{n}", "method": "POST", "url": "/v1/chat/completions",
                "body": {
                    "model": "m", "max_tokens": tokens, "ignore_eos": True, "temperature": 0.0,
                    "messages": [{"role": "user", "content": [
                        {"type": "text", "text": prompt + " "}, {"type": "file", "file": {"file_id": file_ids[i]}},
                    ]}],
                },
            }) + "\n"
            for n, (i, prompt, _) in enumerate(lines)
        ).encode()  # fmt: skip
        batch_file = http.post("/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", content)})
        start = time.perf_counter()
        batch = http.post("/v1/batches", json={"input_file_id": batch_file.json()["id"]}).json()["id"]
        while http.get("/v1/pool/status").json()["running_requests"] < 32:
            assert time.perf_counter() - start < 120, "the batch never filled the engine"
            time.sleep(0.05)
        busy, loads, running = [], [], []
        while len(busy) < calls and http.get(f"/v1/batches/{batch}").json()["status"] != "completed":
            running.append(http.get("/v1/pool/status").json()["running_requests"])
            busy.append(streamed_ttft(http, next(probes), tokens))
            loads.append(os.getloadavg()[0])
        while (status := http.get(f"/v1/batches/{batch}").json())["status"] not in ("completed", "failed"):
            time.sleep(0.2)
        wall = time.perf_counter() - start
    return {
        "idle": idle, "busy": busy, "load_idle": load_idle, "load_busy": max(loads, default=0.0),
        "running": running, "batch_wall": wall, "completed": status["request_counts"]["completed"],
    }  # fmt: skip


def p50_p95(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return ordered[len(ordered) // 2], ordered[min(len(ordered) - 1, round(len(ordered) * 0.95) - 1)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--hf-lines", type=int, default=100, help="lines generate runs (its rate is per line)")
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--small-cache-mib", type=float, default=0.125, help="a budget below the batch's pictures")
    parser.add_argument("--online", action="store_true", help="also the batch through a server, online TTFT")
    parser.add_argument("--calls", type=int, default=20, help="online image requests per phase")
    args = parser.parse_args()
    torch.set_num_threads(1)
    images = pictures(40 if args.quick else 200)
    lines = bodies(images)
    with tempfile.TemporaryDirectory() as tmp:
        path = qwen2_5_vl(Path(tmp) / "qwen2_5_vl")
        rows: dict[str, dict[str, Any] | str] = {}
        rows["engine, encoder cache on (256 MiB)"] = run_engine(path, lines, args.tokens, 256)
        rows[f"engine, encoder cache {args.small_cache_mib} MiB"] = run_engine(
            path, lines, args.tokens, args.small_cache_mib
        )
        rows["engine, encoder cache off"] = run_engine(path, lines, args.tokens, 0)
        rows["transformers generate, one image at a time"] = hf = run_hf(
            path, images, lines, args.tokens, args.hf_lines
        )
        if not args.no_vllm:
            rows["vLLM 0.32 CPU"] = run_vllm(path, images, lines, args.tokens)
        online = run_online(path, images, lines, args.tokens, args.calls) if args.online else None
    engine = rows["engine, encoder cache on (256 MiB)"]
    assert isinstance(engine, dict)
    same = sum(a == b for a, b in zip(engine["outputs"], hf["outputs"], strict=False))
    print(f"### Images: {len(lines)} lines ({len(images)} distinct images x {len(PROMPTS)} prompts), "
          f"{args.tokens} tokens each, 1 thread, {os.cpu_count()} cores shared")  # fmt: skip
    print()
    print("| system | lines | images/s (wall) | output tokens / CPU s | images encoded | encoder cache at the end "
          "(counted; storage held, most held after a step) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---|")
    for name, row in rows.items():
        if isinstance(row, str):
            print(f"| {name} | - | - | - | - | does not run it: {row} |")
            continue
        cache = "-"
        if "cache_bytes" in row:
            mib = [row[k] / 2**20 for k in ("cache_bytes", "held_bytes", "most_held")]
            cache = f"{row['cached_images']} images, {mib[0]:.3f} MiB; {mib[1]:.3f}, most {mib[2]:.3f} MiB"
        print(
            f"| {name} | {row['lines']} | {row['lines'] / row['wall']:.1f} | {row['tokens'] / row['cpu']:.0f} | "
            f"{row.get('encoded', '-')} | {cache} |"
        )
    print()
    print(f"engine tokens equal to generate's on {same} of the {len(hf['outputs'])} lines generate ran")
    if online is not None:
        (i50, i95), (b50, b95) = p50_p95(online["idle"]), p50_p95(online["busy"])
        print()
        print(f"Online image requests (streamed, a new picture each, {args.tokens} tokens), one after another:")
        print("| phase | calls | TTFT p50 ms | TTFT p95 ms | load average (1 min) |")
        print("|---|---:|---:|---:|---:|")
        print(f"| idle | {len(online['idle'])} | {i50 * 1e3:.0f} | {i95 * 1e3:.0f} | {online['load_idle']:.1f} |")
        print(f"| during the batch | {len(online['busy'])} | {b50 * 1e3:.0f} | {b95 * 1e3:.0f} | "
              f"{online['load_busy']:.1f} (most) |")  # fmt: skip
        print(
            f"batch through the server: {online['completed']} of {len(lines)} lines in {online['batch_wall']:.1f} s "
            f"({online['completed'] / online['batch_wall']:.1f} images/s, online calls included); running sequences "
            f"when each busy call was sent: {min(online['running'], default=0)}-{max(online['running'], default=0)}"
        )


if __name__ == "__main__":
    main()
