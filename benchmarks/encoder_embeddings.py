"""Embedding tokens/s of batchgen's ``EncoderEngine`` against plain transformers loops, on one encoder and workload.

    python benchmarks/encoder_embeddings.py                 # 256 inputs of 16-256 tokens, MiniLM-L6-sized BERT
    python benchmarks/encoder_embeddings.py --device cuda --dtype bfloat16

Model: a BERT with random weights built in code, the shape of all-MiniLM-L6-v2 (hidden 384, 6 layers, 12 heads,
about 22M parameters). Workload: ``--requests`` inputs of uniform random token ids, lengths drawn from
``--prompt-len``. Rows, all in this process on the same model and workload (input tokens per CPU second on CPU,
per wall second on GPU):

- ``batchgen EncoderEngine``: the engine with its default budget (``max_num_batched_tokens`` 2048).
- ``HF one at a time``: ``model(input_ids)`` on each input alone (no padding).
- ``HF padded x32``: right-padded batches of 32 in arrival order.
- ``HF padded x32, length-sorted``: the same after sorting the inputs by length (what sentence-transformers does).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import BertConfig, BertModel, BertTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "batchgen-server" / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "batchgen-schemas" / "src"))

from batchgen.server.engine import EncoderEngine, EngineConfig, EngineRequest, build_engine


def build(path: Path) -> None:
    torch.manual_seed(0)
    config = BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
    BertModel(config).save_pretrained(path)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(config.vocab_size - 5)]
    BertTokenizer(vocab={token: i for i, token in enumerate(vocab)}).save_pretrained(path)


def run_engine(engine: EncoderEngine, prompts: list[list[int]]) -> None:
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(str(i), prompt, task="embed"))
    while engine.has_unfinished_requests():
        engine.step()


def run_padded(model: BertModel, prompts: list[list[int]], batch_size: int) -> None:
    device = model.device
    with torch.inference_mode():
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start : start + batch_size]
            longest = max(map(len, batch))
            ids = torch.tensor([p + [0] * (longest - len(p)) for p in batch], device=device)
            mask = torch.tensor([[1] * len(p) + [0] * (longest - len(p)) for p in batch], device=device)
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
            sums = (hidden.float() * mask.unsqueeze(-1)).sum(dim=1)
            torch.nn.functional.normalize(sums / mask.sum(dim=1, keepdim=True), dim=-1).tolist()


def timed(run: Callable[[], None], device: torch.device) -> tuple[float, float]:
    """Wall and process CPU seconds of the second of two runs (the first warms up)."""
    run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(16, 256))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=None, help="torch threads on CPU (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 30522) for _ in range(rng.randint(*args.prompt_len))] for _ in range(args.requests)]
    tokens = sum(map(len, prompts))
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp))
        engine = build_engine(EngineConfig(model=tmp, device=args.device, dtype=args.dtype))
    assert isinstance(engine, EncoderEngine)
    model, device = engine.model, engine.device
    rows = {
        "batchgen EncoderEngine": timed(lambda: run_engine(engine, prompts), device),
        "HF one at a time": timed(lambda: run_padded(model, prompts, 1), device),
        "HF padded x32": timed(lambda: run_padded(model, prompts, 32), device),
        "HF padded x32, length-sorted": timed(lambda: run_padded(model, sorted(prompts, key=len), 32), device),
    }
    # On CPU, ratios use process CPU time, which other jobs on shared cores cannot inflate; on GPU, wall time.
    measure = 1 if device.type == "cpu" else 0
    baseline = rows["HF padded x32"][measure]
    print(f"{args.requests} inputs, {tokens} tokens, {args.device} {args.dtype}, {torch.get_num_threads()} threads")
    print("| system | wall s | CPU s | tokens/s | vs HF padded x32 |\n|---|---:|---:|---:|---:|")
    for name, (wall, cpu) in rows.items():
        seconds = (wall, cpu)[measure]
        print(f"| {name} | {wall:.2f} | {cpu:.2f} | {tokens / seconds:,.0f} | {baseline / seconds:.2f}x |")


if __name__ == "__main__":
    main()
