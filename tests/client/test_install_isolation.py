"""Every wheel ships the LICENSE; installing the client's wheels into a fresh virtualenv pulls in neither torch nor
transformers, and importing the client loads neither."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
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
@pytest.mark.timeout(240)
def test_wheels_ship_the_license_and_the_client_installs_without_torch(tmp_path: Path) -> None:
    # A clean environment: no PYTHONPATH pointing at the source tree, no inherited virtualenv.
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    pip = ["-m", "pip", "--disable-pip-version-check", "--quiet"]
    wheels = tmp_path / "wheels"
    packages = sorted((ROOT / "packages").iterdir())
    # hatchling from the test environment builds the wheels: no isolated build environment per package to set up.
    subprocess.run(
        [
            sys.executable,
            *pip,
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(wheels),
            *map(str, packages),
        ],
        check=True,
        env=env,
        cwd=tmp_path,
        capture_output=True,
    )
    license = (ROOT / "LICENSE").read_bytes()
    built = sorted(wheels.glob("*.whl"))
    assert [wheel.name.split("-")[0] for wheel in built] == [p.name.replace("-", "_") for p in packages]
    for wheel in built:
        with zipfile.ZipFile(wheel) as archive:
            (licenses,) = [name for name in archive.namelist() if ".dist-info/licenses/" in name]
            assert archive.read(licenses) == license, wheel.name

    venv = tmp_path / "venv"
    # Without a pip of its own (ensurepip is most of a venv's cost): this pip installs into it with --python.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, env=env)
    python = venv / "bin" / "python"
    client_wheels = [str(wheel) for wheel in built if not wheel.name.startswith("batchgen_server")]
    install = [*pip, "--python", str(python), "install", *client_wheels]
    subprocess.run([sys.executable, *install], check=True, env=env, cwd=tmp_path, capture_output=True)

    result = subprocess.run([python, "-c", CHECK], check=True, env=env, cwd=tmp_path, capture_output=True, text=True)
    report = json.loads(result.stdout)
    assert report["installed"] == {"torch": False, "transformers": False, "batchgen.server": False}
    assert report["loaded"] == []
    assert report["client_from"].startswith(str(venv))

    cli = subprocess.run([venv / "bin" / "batchgen", "--help"], env=env, capture_output=True, text=True)
    assert cli.returncode == 0 and "submit" in cli.stdout
