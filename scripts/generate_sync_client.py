"""Generate the blocking client from the asyncio one, as httpcore does: ``_async.py`` is the only hand-kept source.

    python scripts/generate_sync_client.py           # rewrite packages/batchgen-client/src/batchgen/client/_sync.py
    python scripts/generate_sync_client.py --check   # exit 1, with a diff, when _sync.py is stale (a test runs this)

unasync drops ``async``/``await`` and renames tokens (``RENAMES``); ruff then tidies and formats the result, so the
generated file passes the same lint as the rest of the code.
"""

from __future__ import annotations

import argparse
import difflib
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import unasync

CLIENT = Path(__file__).resolve().parents[1] / "packages" / "batchgen-client" / "src" / "batchgen" / "client"
SOURCE, TARGET = CLIENT / "_async.py", CLIENT / "_sync.py"

RENAMES = {
    "AsyncBatchGenHttpClient": "BatchGenHttpClient",
    "AsyncClient": "Client",  # httpx
    "AsyncSleep": "Sleep",
    "asyncio": "time",  # asyncio.sleep -> time.sleep
    "aclose": "close",
    "aread": "read",
    "aiter_bytes": "iter_bytes",
}
HEADER = "# Generated from _async.py by scripts/generate_sync_client.py: do not edit.\n"


def generate() -> str:
    """The content ``_sync.py`` should have."""
    with tempfile.TemporaryDirectory() as work:
        source = Path(work) / SOURCE.name
        shutil.copyfile(SOURCE, source)
        unasync.unasync_files([str(source)], [unasync.Rule("_async.py", "_sync.py", additional_replacements=RENAMES)])
        code = HEADER + source.with_name(TARGET.name).read_text()
    # Sort imports, drop those only the async code used, turn ``for x in y: yield x`` into ``yield from y``.
    for ruff in (["check", "--fix-only", "--unsafe-fixes", "--select", "I,F401,UP028"], ["format"]):
        code = subprocess.run(
            [sys.executable, "-m", "ruff", *ruff, "--quiet", "--stdin-filename", str(TARGET), "-"],
            input=code,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    return code


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only report whether _sync.py is up to date")
    args = parser.parse_args()
    expected, current = generate(), TARGET.read_text()
    if expected == current:
        return 0
    if args.check:
        diff = difflib.unified_diff(current.splitlines(True), expected.splitlines(True), "_sync.py", "generated")
        sys.stdout.writelines(diff)
        print(f"{TARGET} is stale: run python scripts/generate_sync_client.py", file=sys.stderr)
        return 1
    TARGET.write_text(expected)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
