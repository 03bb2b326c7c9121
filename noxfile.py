"""Developer tasks. `python3 -m pip install nox && python3 -m nox -s tests` sets up everything from scratch.

Every session runs in one environment, `.nox/tests` (the path developers' commands use), so torch, the largest
dependency by far, is installed once rather than once per session; each session adds the dependency groups it needs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import nox

nox.options.sessions = ["tests"]

PACKAGES = ["packages/batchgen-schemas", "packages/batchgen-client", "packages/batchgen-server"]
PYPROJECT = nox.project.load_toml("pyproject.toml")
ENV = Path(".nox/tests")
WINDOWS = sys.platform == "win32"
BIN = ENV / ("Scripts" if WINDOWS else "bin")
PYTHON = str(BIN / ("python.exe" if WINDOWS else "python"))

PARALLEL = ["-n", "auto", "--no-loadscope-reorder"]
"""pytest-xdist: a worker per core, each running whole modules, longest first (tests/conftest.py groups and orders
them)."""
TORCH_CPU = "torch==2.13.0"  # what the test suite runs on
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"  # PyTorch's CPU-only wheels: ~200 MB, not ~3 GB of CUDA


def install_torch(session: nox.Session) -> None:
    """CUDA torch where an NVIDIA GPU is present; elsewhere a CPU build, from PyTorch's CPU index when it answers."""
    if subprocess.run([PYTHON, "-m", "pip", "show", "--quiet", "torch"], capture_output=True).returncode == 0:
        return  # installed by an earlier session: delete .nox/tests to reinstall
    if shutil.which("nvidia-smi"):
        pip_install(session, "torch>=2.4")
    elif reachable(TORCH_CPU_INDEX):
        pip_install(session, "--index-url", TORCH_CPU_INDEX, TORCH_CPU)
    else:
        session.warn(
            f"{TORCH_CPU_INDEX} cannot be reached: installing {TORCH_CPU} from the configured package index "
            "(on Linux, PyPI's build is the CUDA one, about 3 GB)"
        )
        pip_install(session, TORCH_CPU)


def reachable(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=10):
            return True
    except OSError:
        return False


def install_project(session: nox.Session, *groups: str) -> None:
    if not Path(PYTHON).exists():
        session.run_install(sys.executable, "-m", "venv", str(ENV), silent=True)
        # venv seeds the pip that Python shipped with (23.2 with 3.11.7): it took 107 s of CPU to resolve and install
        # the test dependencies, where pip 26 takes 19.
        pip_install(session, "--upgrade", "pip>=25")
    install_torch(session)
    editable = [arg for path in PACKAGES for arg in ("-e", path)]
    extras = [dep for group in groups for dep in nox.project.dependency_groups(PYPROJECT, group)]
    pip_install(session, *editable, *extras)


def pip_install(session: nox.Session, *args: str) -> None:
    """--no-compile: pip would compile every module of torch and transformers (30 s of a fresh install) where a run
    imports a small share of them; `run` lets those be compiled once, on first import."""
    session.run_install(PYTHON, "-m", "pip", "install", "--no-compile", *args, silent=True)


def run(session: nox.Session, *args: str) -> None:
    """Run a module of the shared environment, with its scripts first on PATH (tests start `batchgen-server`)."""
    path = os.pathsep.join([str(BIN.resolve()), os.environ.get("PATH", "")])
    # Bytecode is written on first import even where PYTHONDONTWRITEBYTECODE is set (pip compiled none of it).
    env = {"PATH": path, "VIRTUAL_ENV": str(ENV.resolve()), "PYTHONDONTWRITEBYTECODE": ""}
    session.run(PYTHON, *args, env=env)


def install_chromium(session: nox.Session) -> None:
    """Debian's chromium for the browser tests, where it is missing and apt-get may install it (root on Debian);
    elsewhere those tests skip and say why."""
    if shutil.which("chromium") or os.geteuid() != 0 or not Path("/etc/debian_version").exists():
        return
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    session.run_install("apt-get", "update", "-qq", external=True, env=env)
    session.run_install("apt-get", "install", "-y", "-qq", "chromium", external=True, env=env)


@nox.session(venv_backend="none")
def tests(session: nox.Session) -> None:
    """Lint, type-check, then run the whole test suite."""
    install_project(session, "test", "lint")
    install_chromium(session)
    run(session, "-m", "ruff", "check", ".")
    run(session, "-m", "ruff", "format", "--check", ".")
    run(session, "-m", "mypy", *(f"{package}/src" for package in PACKAGES))
    run(session, "-m", "pytest", *PARALLEL, *session.posargs)


@nox.session(venv_backend="none")
def quick(session: nox.Session) -> None:
    """The edit loop's tests, a minute or two: the wire types, the client, the engine and the server's API, without the
    slow ones (crash recovery, storage faults, replicas, the browser and the fuzzers run in ``tests``)."""
    install_project(session, "test")
    quick_tests = ["tests/schemas", "tests/client", "tests/engine", "tests/server", "tests/test_layout.py"]
    run(session, "-m", "pytest", *PARALLEL, "-m", "not slow", *(session.posargs or quick_tests))


@nox.session(venv_backend="none")
def demo(session: nox.Session) -> None:
    """The main job end to end: a server with the demo model processes the example batches through the real API."""
    install_project(session)
    run(session, "examples/demo.py", *session.posargs)


@nox.session(venv_backend="none")
def schemathesis(session: nox.Session) -> None:
    """Every schemathesis check (`--checks all`: no 5xx, answers as published, valid requests accepted and invalid ones
    refused, the API key enforced, OPTIONS and 405 answers) in every phase, against a server with the demo model and an
    API key, from the server's own OpenAPI document; schemathesis.toml lists what the document cannot state. A few
    minutes; arguments go to `schemathesis run`: `nox -s schemathesis -- --max-examples 100 --seed 1`."""
    install_project(session, "test")
    run(session, "benchmarks/fuzz_api.py", *(session.posargs or ["--max-examples", "30", "--continue-on-failure"]))


@nox.session(venv_backend="none")
def explore(session: nox.Session) -> None:
    """The property and fuzz tests with new random cases each run (the suite draws the same ones every time, so it
    fails only on a change): `nox -s explore -- --hypothesis-seed 7`."""
    install_project(session, "test")
    tests = [
        "tests/fuzz/test_request_bodies.py",
        "tests/schemas",
        "tests/server/test_server_errors.py",
        "tests/reliability/test_security_limits.py",
    ]
    run(session, "-m", "pytest", *tests, "--hypothesis-profile", "explore", *session.posargs)


@nox.session(venv_backend="none")
def bench(session: nox.Session) -> None:
    """Run one benchmark script: `nox -s bench -- benchmarks/validator.py`."""
    install_project(session, "test")
    run(session, *(session.posargs or ["benchmarks/validator.py"]))
