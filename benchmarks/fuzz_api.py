"""Fuzz the live API from its own OpenAPI schema with schemathesis: zero 5xx and zero schema violations expected.

Starts a server (demo model, an API key) on a free loopback port and runs ``schemathesis run`` against
``/schema/openapi.json`` with every phase (examples, coverage, fuzzing, stateful) for ``--max-time`` seconds, checking
that no answer is a 5xx (``not_a_server_error``) and that every answer matches the schema the server publishes
(``response_schema_conformance``, ``content_type_conformance``). The suite runs a bounded pass of the same checks in
``tests/fuzz/test_api_schemathesis.py``.

    python benchmarks/fuzz_api.py                 # 5 minutes
    python benchmarks/fuzz_api.py --max-time 60

Exit status: schemathesis's (0 when nothing failed).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from batchgen.server.launcher import ServerProcess

CHECKS = "not_a_server_error,response_schema_conformance,content_type_conformance"
API_KEY = "fuzz-key-0123456789"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-time", type=int, default=300, help="seconds of fuzzing")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
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
            CHECKS,
            "--max-time",
            str(args.max_time),
            "--workers",
            str(args.workers),
            "--header",
            f"Authorization: Bearer {API_KEY}",
            *(["--seed", str(args.seed)] if args.seed is not None else []),
        ]
        return subprocess.run(command, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
