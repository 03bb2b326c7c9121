"""``_sync.py`` is generated from ``_async.py``; this fails when someone edits one without regenerating the other."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "generate_sync_client.py"


def test_sync_client_is_generated_from_the_async_one() -> None:
    check = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
