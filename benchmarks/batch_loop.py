"""The batch loop under a huge batch: memory, fairness to a small batch, and cancellation, on one server in one run.

A 50,000-request input file of about 4 KB a line (over 200 MB: a long system prompt in Greek shared by every line,
which JSON escapes to six bytes a letter, then a short question of its own) runs on the demo model, and the script
reports:

1. the server's RSS while the big batch runs (its validation pass over the file included) against the idle server
   (target: less than 300 MB more);
2. the completion time of a 10-request batch created while the big one runs, against the same batch on the idle
   server, in the same run (target: at most 3x);
3. the time from POST /cancel to ``cancelled`` on a second copy of the big batch once it runs (target: under 5 s).

    python benchmarks/batch_loop.py                         # 50,000 requests, to completion
    python benchmarks/batch_loop.py --requests 5000 --no-results

Appends a "Batch loop" section to benchmarks/RESULTS.md unless ``--no-results``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from api_latency import RssSampler, append_section

from batchgen.server.launcher import ServerProcess

_INSTRUCTIONS = (
    "Είστε ένας ακριβής και έντιμος βοηθός: απαντάτε στα ελληνικά, εξηγείτε τα βασικά βήματα, αποφεύγετε τις "
    "γενικότητες, αναφέρετε τις υποθέσεις, επισημαίνετε την αβεβαιότητα, ελέγχετε τις μονάδες, περιγράφετε τα "
    "ενδιάμεσα αποτελέσματα και κλείνετε με ένα σύντομο, σαφές και βέβαιο συμπέρασμα. "
) * 3
SYSTEM = _INSTRUCTIONS[: _INSTRUCTIONS.rindex(" ", 0, 730)]
"""Shared by every request (the prefix cache serves it). JSON-escaped, six bytes a letter, it makes lines of about
4.1 KB: 50,000 of them are 205 MB, within the 200 MiB upload limit."""


def request(custom_id: str, question: str, max_tokens: int) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    body = {"model": "demo", "messages": messages, "max_tokens": max_tokens, "ignore_eos": True}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def write_input(path: Path, count: int, prefix: str, max_tokens: int) -> int:
    with open(path, "w") as f:  # json.dumps escapes every non-ASCII character: \u00e9
        for i in range(count):
            f.write(json.dumps(request(f"{prefix}-{i}", f"Ερώτηση {i}: πόσο κάνουν {i} και {i % 97};", max_tokens)))
            f.write("\n")
    return path.stat().st_size


class Server:
    def __init__(self, process: ServerProcess) -> None:
        self.http = httpx.Client(base_url=process.base_url, timeout=300)

    def upload(self, path: Path) -> str:
        with open(path, "rb") as f:
            response = self.http.post("/v1/files", data={"purpose": "batch"}, files={"file": (path.name, f)})
        response.raise_for_status()
        return str(response.json()["id"])

    def create(self, file_id: str) -> str:
        response = self.http.post("/v1/batches", json={"input_file_id": file_id})
        response.raise_for_status()
        return str(response.json()["id"])

    def batch(self, batch_id: str) -> dict[str, Any]:
        return self.http.get(f"/v1/batches/{batch_id}").json()  # type: ignore[no-any-return]

    def wait(self, batch_id: str, statuses: set[str], poll_s: float = 0.02) -> dict[str, Any]:
        while (batch := self.batch(batch_id))["status"] not in statuses:
            time.sleep(poll_s)
        return batch

    def run_small(self, file_id: str) -> float:
        """Seconds from creating the batch to its completion."""
        start = time.perf_counter()
        batch = self.wait(self.create(file_id), {"completed", "failed"})
        assert batch["request_counts"]["completed"] == 10, batch
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=50_000)
    parser.add_argument("--max-tokens", type=int, default=4, help="per request of the big batch")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="the engine's running set (see RESULTS.md)")
    parser.add_argument("--small-runs", type=int, default=5, help="runs of the small batch, alone and beside")
    parser.add_argument("--no-results", action="store_true")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="batchgen-loop-") as tmp:
        big_path, small_path = Path(tmp) / "big.jsonl", Path(tmp) / "small.jsonl"
        size = write_input(big_path, args.requests, "big", args.max_tokens)
        write_input(small_path, 10, "small", 16)
        flags = ("--max-num-seqs", str(args.max_num_seqs), "--torch-threads", "1")
        with ServerProcess(Path(tmp) / "storage", *flags) as process:
            assert process.process is not None
            server, sampler = Server(process), RssSampler(process.process.pid)
            small_id = server.upload(small_path)
            server.run_small(small_id)  # warm up
            alone = [server.run_small(small_id) for _ in range(args.small_runs)]
            idle_kib = sampler.rss_kib()

            big_id = server.upload(big_path)
            sampler.start()
            started = time.perf_counter()
            big = server.create(big_id)
            running = server.wait(big, {"in_progress"}, poll_s=0.1)
            while running["request_counts"]["completed"] < 1000:
                time.sleep(0.5)
                running = server.batch(big)
            beside = [server.run_small(small_id) for _ in range(args.small_runs)]
            done = server.wait(big, {"completed", "failed"}, poll_s=1.0)
            big_s = time.perf_counter() - started
            peak_kib = sampler.peak_kib

            second = server.create(big_id)
            while server.batch(second)["request_counts"]["completed"] < 200:
                time.sleep(0.2)
            asked = time.perf_counter()
            server.http.post(f"/v1/batches/{second}/cancel").raise_for_status()
            cancelled = server.wait(second, {"cancelled"})
            cancel_s = time.perf_counter() - asked
            sampler.stop()

    counts = done["request_counts"]
    assert done["status"] == "completed" and counts["completed"] == args.requests, done
    figures = {
        "requests": args.requests,
        "mb": size / 1e6,
        "max_num_seqs": args.max_num_seqs,
        "big_s": big_s,
        "idle_mib": idle_kib / 1024,
        "peak_mib": peak_kib / 1024,
        "alone_s": statistics.median(alone),
        "beside_s": statistics.median(beside),
        "cancel_s": cancel_s,
        "cancelled_done": cancelled["request_counts"]["completed"],
    }
    report(figures)
    if not args.no_results:
        append_results(figures)


def report(f: dict[str, Any]) -> None:
    growth = f["peak_mib"] - f["idle_mib"]
    ratio = f["beside_s"] / f["alone_s"]
    print(f"\nbig batch: {f['requests']:,} requests, {f['mb']:.0f} MB, completed in {f['big_s']:.0f} s")
    print(f"{'measure':<44} {'value':>12} {'target':>10}")
    print(f"{'server RSS idle':<44} {f['idle_mib']:>9.0f} MiB")
    print(f"{'server RSS peak while the big batch ran':<44} {f['peak_mib']:>9.0f} MiB")
    print(f"{'growth':<44} {growth:>9.0f} MiB {'< 300 MiB':>10}")
    print(f"{'10-request batch alone (median)':<44} {f['alone_s']:>10.2f} s")
    print(f"{'10-request batch beside the big one (median)':<44} {f['beside_s']:>10.2f} s")
    print(f"{'ratio':<44} {ratio:>11.2f}x {'<= 3x':>10}")
    print(f"{'cancel -> cancelled':<44} {f['cancel_s']:>10.2f} s {'< 5 s':>10}")


def append_results(f: dict[str, Any]) -> None:
    growth, ratio = f["peak_mib"] - f["idle_mib"], f["beside_s"] / f["alone_s"]
    lines = [
        "",
        "## Batch loop",
        "",
        f"`python benchmarks/batch_loop.py` on {platform.machine()}, CPU, demo model, {time.strftime('%Y-%m-%d')}, "
        f"`--max-num-seqs {f['max_num_seqs']} --torch-threads 1`. Big batch: {f['requests']:,} chat requests, "
        f"{f['mb']:.0f} MB, completed in {f['big_s']:.0f} s; the 10-request batch: median of the runs.",
        "",
        "| measure | value | target |",
        "|---|---:|---:|",
        f"| server RSS idle | {f['idle_mib']:.0f} MiB | |",
        f"| server RSS peak while the big batch ran | {f['peak_mib']:.0f} MiB | |",
        f"| growth | {growth:.0f} MiB | < 300 MiB |",
        f"| 10-request batch alone | {f['alone_s']:.2f} s | |",
        f"| 10-request batch beside the big one | {f['beside_s']:.2f} s | |",
        f"| ratio | {ratio:.2f}x | <= 3x |",
        f"| cancel -> cancelled (a second big batch, {f['cancelled_done']} done) | {f['cancel_s']:.2f} s | < 5 s |",
        "",
    ]
    append_section(lines)


if __name__ == "__main__":
    main()
