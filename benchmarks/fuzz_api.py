"""Fuzz the live API from its own OpenAPI schema with schemathesis and every one of its checks: zero failures
expected.

Starts a server (demo model, an API key) on a free loopback port and runs ``schemathesis run --checks all`` against
``/schema/openapi.json`` with every phase (examples, coverage, fuzzing, stateful): no answer a 5xx, every answer as
published, schema-valid requests accepted and invalid ones refused, the key enforced, OPTIONS and 405 answers right.
``schemathesis.toml`` (read from the checkout's root, where this runs) lists what the document cannot state. The suite
runs a bounded pass of the same checks in ``tests/fuzz/test_api_schemathesis.py``; ``nox -s schemathesis`` runs this.

    python benchmarks/fuzz_api.py                                   # 5 minutes
    python benchmarks/fuzz_api.py --max-time 60
    python benchmarks/fuzz_api.py --max-examples 30 --continue-on-failure   # other arguments go to schemathesis

Exit status: schemathesis's (0 when nothing failed).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from batchgen.server.launcher import ServerProcess

API_KEY = "fuzz-key-0123456789"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-time", type=int, default=None, help="seconds of fuzzing (default: 300 unless examples)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=None)
    args, passed = parser.parse_known_args()
    max_time = args.max_time or (None if "--max-examples" in passed else 300)
    with (
        tempfile.TemporaryDirectory(prefix="batchgen-fuzz-") as storage,
        ServerProcess(Path(storage), "--api-key", API_KEY) as server,
    ):
        command = [
            sys.executable,
            "-m",
            "schemathesis.cli",
            "run",
            f"{server.base_url}/schema/openapi.json",
            "--checks",
            "all",
            *(["--max-time", str(max_time)] if max_time else []),
            "--workers",
            str(args.workers),
            "--header",
            f"Authorization: Bearer {API_KEY}",
            *(["--seed", str(args.seed)] if args.seed is not None else []),
            *passed,
        ]
        return subprocess.run(command, check=False, cwd=Path(__file__).parents[1]).returncode


if __name__ == "__main__":
    sys.exit(main())
