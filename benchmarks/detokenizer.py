"""The incremental detokenizer's cost a token: ``tokenizers``' ``DecodeStream`` against the window decodes through
transformers' ``decode`` (the path of slow tokenizers), alternating, on the same token sequences.

    python benchmarks/detokenizer.py
    python benchmarks/detokenizer.py --batch 64 256 --rounds 3

Tokenizers: ``structured.py``'s byte-level BPE of 32,000 tokens (trained in code once, then cached) and the demo
model's byte tokenizer. Sequences: text of the BPE's training kind (JSON and words) encoded, as a model's output
would be, and random token ids (as the benchmarks' random-weight models produce: characters split between tokens,
invalid UTF-8), ``--batch`` of them (the engine detokenizes a step's sequences one after another, so the batch
changes only what the caches hold). Each sequence is detokenized token by token with a stop string that never
matches (a request's stop check runs on every token), then finished; both paths must give the same text.
Microseconds a token, the median of ``--rounds``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "batchgen-server" / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "batchgen-schemas" / "src"))

import structured

from batchgen.server.engine.loading.demo_model import build_tokenizer
from batchgen.server.engine.sampling.detokenizer import IncrementalDetokenizer


class WindowsOnly:
    """A tokenizer's ``decode`` alone, as a slow tokenizer offers it: the detokenizer then decodes its windows."""

    def __init__(self, tokenizer: Any) -> None:
        self.decode = tokenizer.decode


def detokenize(tokenizer: Any, sequences: list[list[int]]) -> tuple[float, list[str]]:
    """Microseconds a token, and the texts."""
    texts = []
    start = time.perf_counter()
    for ids in sequences:
        detokenizer = IncrementalDetokenizer(tokenizer, ("\x00never",))
        for token in ids:
            detokenizer.add(token)
        texts.append(detokenizer.finish())
    return (time.perf_counter() - start) / sum(map(len, sequences)) * 1e6, texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256], help="sequences a case")
    parser.add_argument("--length", type=int, default=256, help="tokens a sequence")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    cache = Path(tempfile.gettempdir()) / "batchgen-bench"
    cache.mkdir(exist_ok=True)
    bpe = structured.train_tokenizer(json.loads(structured.CORPUS.read_text()), cache)
    rng = random.Random(0)
    words = ["".join(rng.choices("bcdfghklmnprstvzaeiouäöüé", k=rng.randint(1, 9))) for _ in range(2000)]

    def document() -> str:
        return json.dumps({rng.choice(words): rng.choice(words)}) + " " + " ".join(rng.choices(words, k=200))

    demo = build_tokenizer()
    print(f"us a token, sequences of {args.length} tokens, median of {args.rounds} rounds\n")
    print("| tokens | batch | DecodeStream | windows through `decode` | windows / DecodeStream |")
    print("|---|---:|---:|---:|---:|")
    for batch in args.batch:
        cases = {
            "32k BPE, text": (bpe, [bpe.encode(document())[: args.length] for _ in range(batch)]),
            "32k BPE, random ids": (bpe, [rng.choices(range(len(bpe)), k=args.length) for _ in range(batch)]),
            "demo byte tokenizer, random ids": (
                demo,
                [rng.choices(range(len(demo)), k=args.length) for _ in range(batch)],
            ),
        }
        for name, (tokenizer, sequences) in cases.items():
            stream, windows = [], []
            for _ in range(args.rounds):
                us, streamed = detokenize(tokenizer, sequences)
                stream.append(us)
                us, windowed = detokenize(WindowsOnly(tokenizer), sequences)
                windows.append(us)
                assert streamed == windowed, name
            ratio = statistics.median(w / s for w, s in zip(windows, stream, strict=True))
            us = f"{statistics.median(stream):.2f} | {statistics.median(windows):.2f}"
            print(f"| {name} | {batch} | {us} | {ratio:.1f}x |")


if __name__ == "__main__":
    main()
