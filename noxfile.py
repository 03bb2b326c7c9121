"""Developer tasks. `python3 -m pip install nox && python3 -m nox -s tests` sets up everything from scratch."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["tests"]

PACKAGES = ["packages/batchgen-schemas", "packages/batchgen-client", "packages/batchgen-server"]
PYPROJECT = nox.project.load_toml("pyproject.toml")


def install_torch(session: nox.Session) -> None:
    """A CPU build where no NVIDIA GPU is present (small, and what the test suite runs on); CUDA otherwise."""
    if shutil.which("nvidia-smi"):
        session.install("torch>=2.4")
    else:
        session.install("torch==2.13.0")


def install_project(session: nox.Session, *groups: str) -> None:
    install_torch(session)
    editable = [arg for path in PACKAGES for arg in ("-e", path)]
    extras = [dep for group in groups for dep in nox.project.dependency_groups(PYPROJECT, group)]
    session.install(*editable, *extras)


def install_chromium(session: nox.Session) -> None:
    """Debian's chromium for the browser tests, where it is missing and apt-get may install it (root on Debian);
    elsewhere those tests skip and say why."""
    if shutil.which("chromium") or os.geteuid() != 0 or not Path("/etc/debian_version").exists():
        return
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    session.run_install("apt-get", "update", "-qq", external=True, env=env)
    session.run_install("apt-get", "install", "-y", "-qq", "chromium", external=True, env=env)


@nox.session
def tests(session: nox.Session) -> None:
    """Lint, type-check, then run the whole test suite."""
    install_project(session, "test", "lint")
    install_chromium(session)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy", "packages/batchgen-schemas/src", "packages/batchgen-client/src")
    session.run("pytest", *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """The main job end to end: a server with the demo model processes the example batches through the real API."""
    install_project(session)
    session.run("python", "examples/demo.py", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Run one benchmark script: `nox -s bench -- benchmarks/validator.py`."""
    install_project(session, "test")
    session.run("python", *(session.posargs or ["benchmarks/validator.py"]))
