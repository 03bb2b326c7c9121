"""Structured outputs: the same workload unconstrained and with a JSON schema on every request, grammar compile times
over a corpus of real-world schemas, and vLLM's CPU build on the same schemas, in one run.

    python benchmarks/structured.py                 # 256 requests (slow on CPU)
    python benchmarks/structured.py --quick         # 64 requests
    python benchmarks/structured.py --skip vllm     # no peer

Model: engine_throughput.py's ``small`` Llama (35M parameters, random weights) over a byte-level BPE tokenizer of
32,000 tokens trained in code on JSON text and words (cached in ``$BATCHGEN_CACHE_DIR``), so that the grammars meet a
vocabulary of real size with multi-character tokens. Workload: ``--requests`` prompts of random token ids; each
request follows one of 8 schemas of ``structured_schemas.json`` (compact JSON, greedy), at most ``--output-len``
tokens. Rows, all on the same model and prompts, one thread:

- ``batchgen, 8 schemas``: the constrained run (its grammars compiled during the warm-up, as a batch that repeats its
  schemas finds them cached). Its note: how many outputs finished, and how many of those validate (jsonschema).
- ``batchgen, unconstrained``: each request runs (ignore_eos) to the length its constrained twin reached: the same
  tokens, with no grammar. The ratio of the two is what constraining costs.
- ``vLLM (xgrammar)``, ``vLLM (guidance)``: vLLM's CPU build (``--vllm-python``, as engine_throughput.py) with the
  same schemas, compact JSON, greedy, through each of its two backends; its CPU seconds count all of its work.

Then each grammar backend's compile time (p50, p99, max) over the whole corpus, cold: llguidance as the engine runs
it (the schema to a grammar, and the matcher against the vocabulary), and xgrammar when it is installed here.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import string
import tempfile
import time
from pathlib import Path
from typing import Any

import jsonschema
import torch
from engine_throughput import SIZES, Clock, Row, best_round, make_model, print_table, run_vllm, vllm_python

from batchgen.server.engine import EngineConfig, EngineRequest, LLMEngine, SamplingParams
from batchgen.server.engine.sampling.grammar import GrammarCompiler, GrammarError
from batchgen.server.engine.self_check import check_engine
from batchgen.server.serving.structured import json_grammar

CORPUS = Path(__file__).with_name("structured_schemas.json")
WORKLOAD_SCHEMAS = ("person", "sentiment", "invoice", "event", "address", "classification", "review", "log_line")
VOCAB = 32000
PAD, BOS, EOS = 0, 1, 2


def train_tokenizer(schemas: dict[str, Any], cache: Path) -> Any:
    """A byte-level BPE of ``VOCAB`` tokens, trained once on JSON documents of the corpus's keys and on words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = cache / f"structured-bench-tokenizer-{VOCAB}"
    if (path / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(path)
    rng = random.Random(0)
    syllables = [a + b for a in "bcdfghklmnprstvz" for b in "aeiou"] + list(string.ascii_lowercase)
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(40000)]
    keys = sorted({key for schema in schemas.values() for key in _keys(schema)})

    def documents() -> Any:
        for _ in range(60000):
            value = {rng.choice(keys): rng.choice([rng.choice(words), rng.randint(0, 99999), rng.random() > 0.5])}
            yield json.dumps(value, separators=(",", ":")) + " " + " ".join(rng.choices(words, k=12))

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    return fast


def _keys(schema: Any) -> list[str]:
    if isinstance(schema, dict):
        own = list(schema.get("properties", {})) if isinstance(schema.get("properties"), dict) else []
        return own + [key for value in schema.values() for key in _keys(value)]
    if isinstance(schema, list):
        return [key for value in schema for key in _keys(value)]
    return []


def compact_grammar(schema: dict[str, Any]) -> str:
    """The grammar the server makes of ``structured_outputs: {"json": schema, "disable_any_whitespace": true}``."""
    return json_grammar(schema, lenient=False, options={"whitespace_flexible": False})


def run(
    model: Any, tokenizer: Any, config: EngineConfig, requests: list[tuple[list[int], SamplingParams]]
) -> tuple[Row, list[Any]]:
    engine = LLMEngine(model, tokenizer, config, "bench")
    check_engine(engine)  # as build_engine does
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(EngineRequest(f"r{i}", prompt, params))
    outputs: list[Any] = [None] * len(requests)
    clock = Clock()
    while engine.has_unfinished_requests():
        for result in engine.step():
            if result.error is not None:
                raise RuntimeError(f"{result.request_id}: {result.error.message}")
            outputs[int(result.request_id[1:])] = result.outputs[0]
    row = Row("", sum(len(output.token_ids) for output in outputs), *clock.elapsed())
    return row, outputs


def validity(outputs: list[Any], schemas: list[dict[str, Any]]) -> str:
    finished = [(o, s) for o, s in zip(outputs, schemas, strict=True) if o.finish_reason == "stop"]
    valid = 0
    for output, schema in finished:
        try:
            jsonschema.validate(json.loads(output.text), schema)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return f"{len(finished)}/{len(outputs)} outputs finished, {valid} of them valid"


def vllm_validity(tokenizer: Any, tokens: list[list[int]], schemas: list[dict[str, Any]]) -> str:
    valid = 0
    for ids, schema in zip(tokens, schemas, strict=True):
        try:
            jsonschema.validate(json.loads(tokenizer.decode(ids, skip_special_tokens=True)), schema)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            continue
    return f"{valid}/{len(tokens)} outputs complete and valid"


def compile_times(tokenizer: Any, schemas: dict[str, Any]) -> list[str]:
    """Each backend's cold compile time over the corpus (the vocabulary's own setup excluded, reported apart)."""
    lines = ["| backend | schemas | p50 ms | p99 ms | max ms (schema) | refused | vocabulary setup s |"]
    lines.append("|---|" + "---:|" * 6)
    compiler = GrammarCompiler(tokenizer, VOCAB, timeout_s=60)  # each schema's grammar is new to its cache
    clock = time.perf_counter()
    compiler.compile(json_grammar({"type": "string"}, lenient=False))
    setup = time.perf_counter() - clock
    times, refused = {}, []
    for name, schema in schemas.items():
        clock = time.perf_counter()
        try:
            compiler.compile(compact_grammar(schema))
            times[name] = time.perf_counter() - clock
        except GrammarError:  # a keyword llguidance does not implement: refused by name (strict)
            refused.append(name)
    lines.append(_compile_row("llguidance (batchgen)", times, refused, setup))
    try:
        import xgrammar
    except ImportError:
        lines.append("| xgrammar | - | - | - | - | - | not installed here |")
        return lines
    clock = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB)
    setup = time.perf_counter() - clock
    times, refused = {}, []
    for name, schema in schemas.items():
        xcompiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        clock = time.perf_counter()
        try:
            xgrammar.GrammarMatcher(xcompiler.compile_json_schema(json.dumps(schema), any_whitespace=False))
            times[name] = time.perf_counter() - clock
        except Exception:  # xgrammar raises its own RuntimeError for a schema it cannot build
            refused.append(name)
    lines.append(_compile_row("xgrammar", times, refused, setup))
    return lines


def _compile_row(name: str, times: dict[str, float], refused: list[str], setup: float) -> str:
    values = sorted(times.values())
    p99 = values[min(len(values) - 1, round(0.99 * (len(values) - 1)))]
    slowest = max(times, key=lambda key: times[key])
    cells = [name, str(len(values)), f"{1e3 * statistics.median(values):.1f}", f"{1e3 * p99:.1f}"]
    cells += [f"{1e3 * times[slowest]:.1f} ({slowest})", ", ".join(refused) or "none", f"{setup:.2f}"]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(16, 256))
    parser.add_argument("--output-len", type=int, nargs=2, default=(64, 256))
    parser.add_argument("--quick", action="store_true", help="64 requests")
    parser.add_argument("--size", choices=SIZES, default="small")
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=1, help="runs of each row, alternating (the best)")
    parser.add_argument("--skip", nargs="*", default=(), choices=("vllm", "compile"))
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--kv-cache-gib", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.device, args.dtype = "cpu", "float32"
    if args.quick:
        args.requests = 64
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    corpus = json.loads(CORPUS.read_text())
    cache = Path(tempfile.gettempdir()) / "batchgen-bench"
    cache.mkdir(exist_ok=True)
    tokenizer = train_tokenizer(corpus, cache)
    model = make_model(args.size, "cpu", torch.float32)
    model.generation_config.eos_token_id = EOS  # constrained outputs end where their grammar does
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(*args.prompt_len))] for _ in range(args.requests)]
    caps = [rng.randint(*args.output_len) for _ in prompts]
    schemas = [corpus[WORKLOAD_SCHEMAS[i % len(WORKLOAD_SCHEMAS)]] for i in range(len(prompts))]
    grammars = [compact_grammar(schema) for schema in schemas]
    config = EngineConfig(
        device="cpu", dtype="float32", cpu_kv_cache_gib=args.kv_cache_gib,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=256,
    )  # fmt: skip
    header = (
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.machine()}, {args.threads} CPU thread(s); "
        f"torch {torch.__version__}; {args.requests} requests, prompts {args.prompt_len[0]}-{args.prompt_len[1]}, "
        f"at most {args.output_len[0]}-{args.output_len[1]} output tokens; {len(WORKLOAD_SCHEMAS)} schemas"
    )
    print(header, flush=True)

    constrained = [
        (p, SamplingParams(max_tokens=c, grammar=g)) for p, c, g in zip(prompts, caps, grammars, strict=True)
    ]
    run(model, tokenizer, config, constrained[: 2 * len(WORKLOAD_SCHEMAS)])  # warm-up; the grammars compile here
    python = None if "vllm" in args.skip else vllm_python(args.vllm_python)
    rounds: dict[str, list[Row]] = {}
    notes: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as model_dir:
        if python is not None:
            model.save_pretrained(model_dir)
            tokenizer.save_pretrained(model_dir)
        for _ in range(args.rounds):
            row, outputs = run(model, tokenizer, config, constrained)
            rounds.setdefault("batchgen, 8 schemas", []).append(row)
            notes["batchgen, 8 schemas"] = validity(outputs, schemas)
            lengths = [max(1, len(output.token_ids)) for output in outputs]
            free = [(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in zip(prompts, lengths, strict=True)]
            row, _ = run(model, tokenizer, config, free)
            rounds.setdefault("batchgen, unconstrained", []).append(row)
            notes["batchgen, unconstrained"] = "each request to its constrained twin's length, no grammar"
            for backend in ("xgrammar", "guidance") if python is not None else ():
                workload = [[p, c, s] for p, c, s in zip(prompts, caps, schemas, strict=True)]
                row, tokens = run_vllm(
                    python, Path(model_dir), workload, args, False, ("--structured-backend", backend)
                )
                name = f"{row.name.split(' (')[0]} ({backend})"
                rounds.setdefault(name, []).append(row)
                notes[name] = vllm_validity(tokenizer, tokens, schemas)
    rows = []
    for name, runs in rounds.items():
        row = best_round(runs)
        row.name, row.note = name, f"{notes[name]}; {row.note}".rstrip("; ")
        rows.append(row)
    print()
    print(header)
    print_table("Throughput, constrained and not", rows, rows[0], cpu=True)
    share = rows[0].tokens_per_second(True) / rows[1].tokens_per_second(True)
    print(f"constrained at {share:.2f}x the unconstrained tokens per CPU-second")
    if python is None and "vllm" not in args.skip:
        print("vLLM: skipped, no interpreter with vLLM (set BATCHGEN_VLLM_PYTHON or --vllm-python)")
    if "compile" not in args.skip:
        print()
        print(f"### Grammar compile time, {len(corpus)} schemas of {CORPUS.name}, cold, {VOCAB:,}-token vocabulary")
        print()
        print("\n".join(compile_times(tokenizer, corpus)))


if __name__ == "__main__":
    main()
