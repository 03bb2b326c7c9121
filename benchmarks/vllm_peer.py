"""vLLM on the benchmark's model and workload, in vLLM's own virtualenv: the peer row of engine_throughput.py and
structured.py.

    VENV/bin/python benchmarks/vllm_peer.py MODEL_DIR WORKLOAD_JSON OUT_JSON --threads 1 [--eager] [--device cpu]

Runs vLLM in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so process CPU time counts all of its work, on
``--threads`` threads, with the engine's batching limits; greedy, ignore_eos, each request's own output length (with
``--loras``, its own LoRA adapter). A
workload item ``[prompt, length, schema]`` is constrained instead: compact JSON of ``schema`` (vLLM's
``structured_outputs``, backend ``--structured-backend``), ending where the grammar does, at most ``length`` tokens.
Writes wall and CPU seconds of the timed run (after an 8-request warm-up, as for the engine) and every request's
tokens. This file imports nothing of batchgen: vLLM and batchgen do not share an environment.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("workload")
    parser.add_argument("out")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--eager", action="store_true", help="enforce_eager: no torch.compile, no graphs")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kv-cache-gib", type=float, default=4, help="KV cache memory on CPU (whole GiB, 1 at least)")
    parser.add_argument("--structured-backend", default="auto", help="xgrammar, guidance or auto (vLLM's choice)")
    parser.add_argument("--loras", help="a JSON list: each request's LoRA adapter directory ('' for the base)")
    parser.add_argument("--max-lora-rank", type=int, default=16)
    parser.add_argument("--quantization", default=None, help="vLLM's in-flight quantization (bitsandbytes...)")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks, one process each (mp backend)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if args.device == "cpu":
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(args.kv_cache_gib)))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0" if args.threads == 1 else "all")
        os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    torch.set_num_threads(args.threads)
    with open(args.workload) as f:
        workload = json.load(f)
    loras: list[str] = []
    lora_args = {}
    if args.loras:
        with open(args.loras) as f:
            loras = json.load(f)
        distinct = sorted(set(filter(None, loras)))
        lora_args = {"enable_lora": True, "max_loras": len(distinct), "max_lora_rank": args.max_lora_rank}
    llm = LLM(
        **lora_args,
        model=args.model_dir,
        dtype=args.dtype,
        enforce_eager=args.eager,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=256,
        max_model_len=args.max_model_len,
        seed=0,
        structured_outputs_config={"backend": args.structured_backend},
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        **(
            {"tensor_parallel_size": args.tensor_parallel_size, "distributed_executor_backend": "mp"}
            if args.tensor_parallel_size > 1
            else {}
        ),
    )
    prompts = [TokensPrompt(prompt_token_ids=item[0]) for item in workload]
    params = [
        SamplingParams(max_tokens=item[1], ignore_eos=True, temperature=0.0)
        if len(item) < 3
        else SamplingParams(
            max_tokens=item[1],
            temperature=0.0,
            structured_outputs=StructuredOutputsParams(json=item[2], disable_any_whitespace=True),
        )
        for item in workload
    ]
    requests = None
    if loras:
        from vllm.lora.request import LoRARequest

        ids = {path: i + 1 for i, path in enumerate(sorted(set(filter(None, loras))))}
        requests = [LoRARequest(f"lora{ids[path]}", ids[path], path) if path else None for path in loras]
    llm.generate(prompts[:8], params[:8], use_tqdm=False, lora_request=requests and requests[:8])  # warm-up
    # The engine measures with a cold cache (a fresh engine after its warm-up): so does vLLM, whose prefix cache
    # would otherwise serve the warm-up's 8 prompts.
    llm.reset_prefix_cache()
    wall, cpu = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=requests)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    tokens = [list(output.outputs[0].token_ids) for output in outputs]
    with open(args.out, "w") as f:
        json.dump({"wall": wall, "cpu": cpu, "tokens": tokens, "version": _version()}, f)


def _version() -> str:
    import vllm

    return str(vllm.__version__)


if __name__ == "__main__":
    main()
