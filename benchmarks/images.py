"""Image lines through a tiny Qwen2.5-VL-shaped model: images/s and output tokens per CPU second, the encoder cache
on and off, against transformers' ``generate`` one image at a time and vLLM's CPU build on the same directory.

    python benchmarks/images.py            # 1,000 lines: 200 distinct images x 5 prompts
    python benchmarks/images.py --quick    # 200 lines: 40 images x 5 prompts

Each line is a chat (the prompt's text, then the picture as a data URL) made ready by the serving layer (base64
decoded, Pillow, the processor: counted in the engine's time) and run greedily for ``--tokens`` tokens, ignore_eos.
The text comes before the picture, so the prefix cache cannot stand in for the encoder cache (the same picture after
another prompt). The engine's outputs are checked token for token against ``generate`` on the lines it runs.
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
from vlm_helpers import data_url, hf_greedy, image, qwen2_5_vl

from batchgen.schemas import ChatCompletionRequest
from batchgen.server.engine import EngineConfig, LLMEngine
from batchgen.server.engine.multimodal.processor import ImageProcessor
from batchgen.server.serving import BatchDefaults, OpenAIServing
from batchgen.server.serving.config import ServingConfig
from batchgen.server.serving.images import ImagePrompter, media_of

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


def run_engine(path: Path, lines: list[Any], tokens: int, cache_mib: int) -> dict[str, Any]:
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    processor = ImageProcessor(str(path), None)
    tokenizer = processor.processor.tokenizer
    config = EngineConfig(model=str(path), dtype="float32", device="cpu", encoder_cache_mib=cache_mib, max_num_seqs=64)
    engine = LLMEngine(model, tokenizer, config, "m")
    serving = OpenAIServing(
        tokenizer, ("m",), 4096, len(tokenizer), images=ImagePrompter(processor, media_of(ServingConfig()))
    )
    defaults = BatchDefaults(max_decoding_length=tokens, temperature=0.0)
    wall, cpu = time.perf_counter(), time.process_time()
    outputs: dict[str, list[int]] = {}
    ids: list[str] = []
    for n, (_, _, body) in enumerate(lines):
        for request in serving.prepare(body, request_id=f"r{n}", defaults=defaults).requests:
            request.params = dataclasses.replace(request.params, ignore_eos=True)
            engine.add_request(request)
            ids.append(request.request_id)
        while engine.has_unfinished_requests() and len(engine.scheduler.waiting) > 64:
            outputs.update((r.request_id, r.outputs[0].token_ids) for r in engine.step() if r.finished)
    while engine.has_unfinished_requests():
        outputs.update((r.request_id, r.outputs[0].token_ids) for r in engine.step() if r.finished)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    vision = engine.runner.vision
    assert vision is not None
    return {
        "wall": wall, "cpu": cpu, "tokens": sum(map(len, outputs.values())), "lines": len(lines),
        "encoded": vision.encoded_images, "cache_bytes": vision.cache.bytes, "cached_images": len(vision.cache),
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--hf-lines", type=int, default=100, help="lines generate runs (its rate is per line)")
    parser.add_argument("--no-vllm", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    images = pictures(40 if args.quick else 200)
    lines = bodies(images)
    with tempfile.TemporaryDirectory() as tmp:
        path = qwen2_5_vl(Path(tmp) / "qwen2_5_vl")
        rows: dict[str, dict[str, Any] | str] = {}
        rows["engine, encoder cache on (256 MiB)"] = run_engine(path, lines, args.tokens, 256)
        rows["engine, encoder cache off"] = run_engine(path, lines, args.tokens, 0)
        rows["transformers generate, one image at a time"] = hf = run_hf(
            path, images, lines, args.tokens, args.hf_lines
        )
        if not args.no_vllm:
            rows["vLLM 0.32 CPU"] = run_vllm(path, images, lines, args.tokens)
    engine = rows["engine, encoder cache on (256 MiB)"]
    assert isinstance(engine, dict)
    same = sum(a == b for a, b in zip(engine["outputs"], hf["outputs"], strict=False))
    print(f"### Images: {len(lines)} lines ({len(images)} distinct images x {len(PROMPTS)} prompts), "
          f"{args.tokens} tokens each, 1 thread, {os.cpu_count()} cores shared")  # fmt: skip
    print()
    print("| system | lines | images/s (wall) | output tokens / CPU s | images encoded | encoder cache |")
    print("|---|---:|---:|---:|---:|---|")
    for name, row in rows.items():
        if isinstance(row, str):
            print(f"| {name} | - | - | - | - | does not run it: {row} |")
            continue
        cache = f"{row['cache_bytes'] / 2**20:.2f} MiB, {row['cached_images']} images" if "cache_bytes" in row else "-"
        print(
            f"| {name} | {row['lines']} | {row['lines'] / row['wall']:.1f} | {row['tokens'] / row['cpu']:.0f} | "
            f"{row.get('encoded', '-')} | {cache} |"
        )
    print()
    print(f"engine tokens equal to generate's on {same} of the {len(hf['outputs'])} lines generate ran")


if __name__ == "__main__":
    main()
