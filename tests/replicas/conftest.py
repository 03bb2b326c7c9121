"""One local Ray for the whole test session, started only when a replica test runs (the other tests never pay for
it), and a server with two CPU replicas of the demo model on it. Its replicas kill themselves on the crash marker
(``tests/faults``): a prompt holding token ids 14, 15, 16 in a row, which no other test's prompt has."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_helpers import LiveServer, ServerProcess

HOLD_RAY = """
import sys, ray
ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
print(ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()  # until the test session ends (or dies: its end of the pipe closes either way)
ray.shutdown()
"""
"""A process that starts Ray (4 logical CPUs: two replicas and room to restart one) and ends it when stdin closes."""
CRASH_MARKER = "14,15,16"


@pytest.fixture(scope="session")
def ray_address() -> Iterator[str]:
    """The address of the session's local Ray; servers join it with ``--ray-address``."""
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed: pip install 'batchgen-server[ray]' (the test dependency group has it)")
    with pytest.MonkeyPatch.context() as patch:
        # Ray secures a cluster it starts with the token in ~/.ray/auth_token; who joins by address must ask for it.
        patch.setenv("RAY_AUTH_MODE", "token")
        faults = str(Path(__file__).parents[1] / "faults")
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([faults, *(p for p in sys.path if p)]),
            "BATCHGEN_TEST_CRASH_MARKER": CRASH_MARKER,
        }  # what Ray's worker processes start with: the replicas
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLD_RAY], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        assert holder.stdout is not None and holder.stdin is not None
        address = holder.stdout.readline().decode().strip()
        if not address:
            holder.wait()
            raise RuntimeError(f"the local Ray did not start (exit status {holder.returncode})")
        yield address
        holder.stdin.close()
        try:
            holder.wait(60)
        except subprocess.TimeoutExpired:
            holder.kill()
            holder.wait()


@pytest.fixture(scope="session")
def replica_flags(ray_address: str) -> tuple[str, ...]:
    """Two small CPU replicas on the session's Ray: 4 sequences each (a window of 10 across both), 4096 tokens of KV
    cache each."""
    engine = ("--torch-threads", "1", "--max-num-seqs", "4", "--num-kv-blocks", "256")
    return ("--replicas", "2", "--ray-address", ray_address, *engine)


@pytest.fixture(scope="module")
def replica_server(
    replica_flags: tuple[str, ...], lora_adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    """A server with two replicas, for one test module (its replicas hold memory), serving two LoRA adapters."""
    lora = ["--enable-lora", "--lora-modules", *(f"{name}={lora_adapters[name]}" for name in ("alpha", "beta"))]
    lora += ["--max-loras", "2", "--max-lora-rank", "8"]
    process = ServerProcess(tmp_path_factory.mktemp("replicas"), *replica_flags, *lora, "--flush-interval-s", "0.05")
    with process:
        server = LiveServer(process)
        yield server
        server.http.close()
