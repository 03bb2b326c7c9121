"""Scoring a corpus: reranking query-document pairs with a cross-encoder and with a decoder reranker of the same
size, and embedding passages with a decoder embedding model, through batchgen's server and vLLM's (``vllm serve``,
its CPU build) on the same model directories, with the same requests.

    python benchmarks/pooling.py                                   # 1,000 queries x 20 documents, 50,000 passages
    python benchmarks/pooling.py --queries 100 --passages 5000     # scaled down (what RESULTS.md records, and why)

Models (random weights, float32, saved as their libraries save them): ``--size`` layers and width for all three (a
BERT cross-encoder of one label with a WordPiece tokenizer; a Qwen3 causal LM with the demo's byte-level tokenizer
plus "yes"/"no" tokens, served as Qwen3-Reranker (``--task score`` here; vLLM's documented
``--hf-overrides`` conversion there, the template applied by the client as vLLM's example does); a Qwen3 sentence-
transformers embedding model, last-token pooling and Normalize (``--runner pooling`` on both).

Each rerank request is one query and its ``--docs`` documents (``/v1/rerank``), ``--concurrency`` at once; each
embedding request ``--batch`` passages (``/v1/embeddings``). Timed after a warm-up of a few requests: wall seconds and
the server process's CPU seconds (with its children: vLLM's engine core), the steadier figure on shared cores.
batchgen's decoder reranker runs twice, with the prefix cache and without (``--no-prefix-caching``): the template and
the query are shared by a query's documents, so the cache computes them once. Parity: every relevance score and
vector of batchgen's within 1e-3 of vLLM's (asserted).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import vllm_python
from scoring import SERVED_NAME, VllmServer, cpu_seconds

from batchgen.server.engine.loading.demo_model import build_tokenizer
from batchgen.server.engine.loading.pooling_spec import (
    QWEN3_RERANKER_INSTRUCTION,
    QWEN3_RERANKER_PREFIX,
    QWEN3_RERANKER_SUFFIX,
)
from batchgen.server.launcher import ServerProcess

SIZES = {
    "small": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4},
    "minilm": {"hidden_size": 384, "intermediate_size": 1536, "num_hidden_layers": 6, "num_attention_heads": 6},
}
WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "sat",
    "on",
    "mat",
    "ran",
    "far",
    "and",
    "big",
    "red",
    "blue",
    "house",
    "tree",
    "river",
    "stone",
    "light",
    "water",
    "city",
    "road",
    "book",
    "night",
    "market",
    "garden",
    "music",
    "paper",
    "window",
    "bridge",
    "winter",
    "summer",
    "engine",
    "signal",
    "table",
    "letter",
]
PARITY = 1e-3


def build_models(root: Path, size: str) -> dict[str, Path]:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Normalize, Pooling, Transformer
    from transformers import (
        AutoModel,
        BertConfig,
        BertForSequenceClassification,
        BertTokenizer,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    dims = SIZES[size]
    head_dim = dims["hidden_size"] // dims["num_attention_heads"]
    torch.manual_seed(0)
    vocab = ["[UNK]", "[PAD]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *"abcdefghijklmnopqrstuvwxyz"]
    bert = BertForSequenceClassification(
        BertConfig(vocab_size=len(vocab), num_labels=1, max_position_embeddings=4096, pad_token_id=1, **dims)
    )
    paths = {"cross-encoder": root / "cross-encoder", "reranker": root / "reranker", "embedder": root / "embedder"}
    bert.save_pretrained(paths["cross-encoder"])
    BertTokenizer(vocab={token: i for i, token in enumerate(vocab)}).save_pretrained(paths["cross-encoder"])

    def qwen3(tokenizer: Any) -> Qwen3Config:
        return Qwen3Config(
            vocab_size=len(tokenizer), num_key_value_heads=dims["num_attention_heads"], head_dim=head_dim,
            max_position_embeddings=4096, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.bos_token_id, tie_word_embeddings=False, **dims,
        )  # fmt: skip

    tokenizer = build_tokenizer()
    tokenizer.chat_template = None
    tokenizer.add_tokens(["yes", "no"])
    reranker = Qwen3ForCausalLM(qwen3(tokenizer))
    reranker.save_pretrained(paths["reranker"])
    tokenizer.save_pretrained(paths["reranker"])
    tokenizer = build_tokenizer()
    tokenizer.chat_template = None
    base = root / "embedder-base"
    AutoModel.from_config(qwen3(tokenizer)).save_pretrained(base)
    tokenizer.save_pretrained(base)
    modules = [Transformer(str(base)), Pooling(dims["hidden_size"], pooling_mode="lasttoken"), Normalize()]
    SentenceTransformer(modules=modules).save(str(paths["embedder"]))
    return paths


def text(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def timed(
    base_url: str, pid: int, url: str, bodies: list[dict[str, Any]], concurrency: int
) -> tuple[list[dict[str, Any]], float, float]:
    """Every body but the first ``2 * concurrency`` posted (``concurrency`` at once) after those, the warm-up (other
    queries and passages: nothing timed is in the prefix cache before it runs): answers, wall and server CPU
    seconds."""
    with httpx.Client(base_url=base_url, timeout=3600) as client:

        def post(body: dict[str, Any]) -> dict[str, Any]:
            response = client.post(url, json={"model": SERVED_NAME, **body})
            assert response.status_code == 200, response.text
            return response.json()  # type: ignore[no-any-return]

        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(post, bodies[: 2 * concurrency]))
            before, start = cpu_seconds(pid), time.perf_counter()
            answers = list(pool.map(post, bodies[2 * concurrency :]))
            return answers, time.perf_counter() - start, cpu_seconds(pid) - before


def scores(answers: list[dict[str, Any]]) -> list[float]:
    """Each request's relevance scores by document index, in order."""
    values = []
    for answer in answers:
        values += [r["relevance_score"] for r in sorted(answer["results"], key=lambda r: r["index"])]
    return values


def vectors(answers: list[dict[str, Any]]) -> torch.Tensor:
    return torch.tensor([item["embedding"] for answer in answers for item in answer["data"]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=SIZES, default="small")
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--docs", type=int, default=20, help="documents per query")
    parser.add_argument("--passages", type=int, default=50_000)
    parser.add_argument("--batch", type=int, default=64, help="passages per embeddings request")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each server")
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096, help="vLLM: at least its context")
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--only", choices=["cross-encoder", "reranker", "embedder"], action="append")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    rng = random.Random(0)
    warm = 2 * args.concurrency  # requests of their own ahead of the timed ones
    queries = [text(rng, 3, 8) for _ in range(warm + args.queries)]
    documents = [[text(rng, 20, 60) for _ in range(args.docs)] for _ in range(warm + args.queries)]
    passages = [text(rng, 15, 50) for _ in range(warm * args.batch + args.passages)]
    pairs = args.queries * args.docs
    rerank = [{"query": q, "documents": d} for q, d in zip(queries, documents, strict=True)]
    # vLLM's Qwen3-Reranker example: the client puts the template around the query and each document.
    head = f"{QWEN3_RERANKER_PREFIX}<Instruct>: {QWEN3_RERANKER_INSTRUCTION}\n<Query>: "
    templated = [
        {"query": f"{head}{q}\n", "documents": [f"<Document>: {doc}{QWEN3_RERANKER_SUFFIX}" for doc in d]}
        for q, d in zip(queries, documents, strict=True)
    ]
    embed = [{"input": passages[i : i + args.batch]} for i in range(0, len(passages), args.batch)]
    python = None if args.no_vllm else vllm_python(args.vllm_python)
    flags = ["--served-model-name", SERVED_NAME, "--dtype", "float32", "--torch-threads", str(args.threads)]
    flags += ["--max-num-batched-tokens", str(args.max_num_batched_tokens), "--cpu-kv-cache-gib", "2"]
    rows: list[tuple[str, int, float, float, str]] = []
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"]}
    overrides["is_original_qwen3_reranker"] = True  # type: ignore[assignment]
    cases = [
        ("cross-encoder", "/v1/rerank", rerank, rerank, pairs, (), ("--runner", "pooling")),
        ("reranker", "/v1/rerank", rerank, templated, pairs, ("--task", "score"),
         ("--runner", "pooling", "--hf-overrides", json.dumps(overrides))),
        ("embedder", "/v1/embeddings", embed, embed, args.passages, ("--runner", "pooling"), ("--runner", "pooling")),
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        paths = build_models(tmp / "models", args.size)
        for name, url, ours_bodies, their_bodies, count, our_flags, their_flags in cases:
            if args.only and name not in args.only:
                continue
            variants = [("", ())] if name != "reranker" else [("", ()), (", no prefix cache", ("--no-prefix-caching",))]
            ours: list[dict[str, Any]] = []
            for label, extra in variants:
                storage = tmp / f"batchgen-{name}{len(rows)}"
                command = [*flags, *our_flags, *extra]
                with ServerProcess(storage, *command, model=str(paths[name]), startup_timeout_s=600) as server:
                    assert server.process is not None
                    answers, seconds, cpu = timed(
                        server.base_url, server.process.pid, url, ours_bodies, args.concurrency
                    )
                if ours and name != "embedder":  # the prefix cache changes no score
                    worst = max(abs(a - b) for a, b in zip(scores(ours), scores(answers), strict=True))
                    assert worst < PARITY, f"{name}{label}: scores differ by {worst:.2e} from the first run's"
                ours = ours or answers
                rows.append((f"batchgen {name}{label}", count, seconds, cpu, ""))
                print(rows[-1], flush=True)
            if python is None:
                continue
            log = tmp / f"vllm-{name}.log"
            try:
                vllm = VllmServer(python, paths[name], args, log, their_flags)
            except RuntimeError:
                print(log.read_text()[-3000:])
                raise
            try:
                answers, seconds, cpu = timed(vllm.base_url, vllm.process.pid, url, their_bodies, args.concurrency)
            finally:
                vllm.stop()
            if name == "embedder":
                worst = (vectors(ours) - vectors(answers)).abs().max().item()
            else:
                worst = max(abs(a - b) for a, b in zip(scores(ours), scores(answers), strict=True))
            assert worst < PARITY, f"{name}: batchgen and vLLM differ by {worst:.2e}"
            rows.append((f"vLLM {name}", count, seconds, cpu, f"batchgen's within {worst:.1e}"))
            print(rows[-1], flush=True)
    what = f"{args.queries} queries x {args.docs} documents, {args.passages} passages"
    print(f"\nmodel {args.size}, float32, {what}, {args.concurrency} requests at once, {args.threads} thread(s)\n")
    print("| system | items | wall s | items/s | server CPU s | items/CPU-s | note |\n|---|---|---|---|---|---|---|")
    for name, count, seconds, cpu, note in rows:
        print(f"| {name} | {count} | {seconds:.1f} | {count / seconds:.1f} | {cpu:.1f} | {count / cpu:.1f} | {note} |")


if __name__ == "__main__":
    main()
