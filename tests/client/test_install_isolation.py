"""Installing the client into a fresh virtualenv pulls in neither torch nor transformers; importing it loads neither."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHECK = """
import importlib.util, json, sys
import batchgen.client, batchgen.client.cli, batchgen.batchgen_client
print(json.dumps({
    "installed": {
        name: importlib.util.find_spec(name) is not None for name in ("torch", "transformers", "batchgen.server")
    },
    "loaded": sorted(name for name in sys.modules if name.split(".")[0] in ("torch", "transformers", "numpy")),
    "client_from": batchgen.client.__file__,
}))
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_client_installs_and_imports_without_torch(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    # A clean environment: no PYTHONPATH pointing at the source tree, no inherited virtualenv.
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=env)
    python = venv / "bin" / "python"
    packages = [str(ROOT / "packages" / "batchgen-schemas"), str(ROOT / "packages" / "batchgen-client")]
    subprocess.run(
        [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *packages],
        check=True,
        env=env,
        cwd=tmp_path,
        capture_output=True,
    )

    result = subprocess.run([python, "-c", CHECK], check=True, env=env, cwd=tmp_path, capture_output=True, text=True)
    report = json.loads(result.stdout)
    assert report["installed"] == {"torch": False, "transformers": False, "batchgen.server": False}
    assert report["loaded"] == []
    assert report["client_from"].startswith(str(venv))

    cli = subprocess.run([venv / "bin" / "batchgen", "--help"], env=env, capture_output=True, text=True)
    assert cli.returncode == 0 and "submit" in cli.stdout
