"""Shared fixtures: a real batchgen server (demo model, loopback port, temporary storage) and helpers to drive it."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings
from server_helpers import TENANT_KEYS, LiveServer, ServerProcess

# The suite is the gate a change lands through: the property tests draw the same cases on every run (a seed from
# each test's name), so a run fails only on a change. `nox -s explore` draws new cases to look for new failures.
settings.register_profile("suite", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile("suite")


SHARED_BY_DIRECTORY = {"replicas": "ray", "browser": "chromium"}
"""Directories whose tests share one costly session fixture (a local Ray, a browser): one worker runs them all."""


LONGEST_FIRST = (
    "ray",
    "chromium",
    "test_architectures.py",
    "test_tensor_parallel_families.py",
    "test_storage_faults.py",
    "test_structured_outputs.py",
    "test_untrusted_media.py",
    "test_tensor_parallel_faults.py",
    "test_quantized.py",
    "test_demo_model.py",
    "test_api_schemathesis.py",
    "test_request_bodies.py",
)
"""Groups of 10 s or more (the stop notes time them), started first; the others follow by their number of tests."""


def group_of(nodeid: str) -> str:
    """A worker runs whole modules (their module-scoped servers start once), and whole directories whose tests share
    a costly session fixture."""
    path = nodeid.split("::", 1)[0]
    return SHARED_BY_DIRECTORY.get(Path(path).parent.name, path)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist's scheduling by scope, the scope being ``group_of`` the test: its own ``loadgroup`` reads groups
    from suffixes of the tests' ids, which pytest 9.2 no longer lets a plugin write (every test ran alone, module
    fixtures started on both workers)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return ByGroup(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest groups first, then the others by their number of tests (``--no-loadscope-reorder`` keeps this
    order: xdist's own puts many-test groups first, so a 20 s module of one test started last and ran alone)."""
    sizes = Counter(group_of(item.nodeid) for item in items)

    def start_order(item: pytest.Item) -> tuple[int, int]:
        group = group_of(item.nodeid)
        name = Path(group).name
        return (LONGEST_FIRST.index(name), 0) if name in LONGEST_FIRST else (len(LONGEST_FIRST), -sizes[group])

    items.sort(key=start_order)  # stable: a group's tests keep their order


@pytest.fixture(scope="module", autouse=True)
def root_logging_kept() -> Iterator[None]:
    """A module that runs the server's CLI in its own process leaves the server's log handler on the root logger (at
    INFO): the next module's captured output (the client CLI's) would carry httpx's request lines."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(scope="session", autouse=True)
def small_kv_cache() -> Iterator[None]:
    """Servers the tests start get a 64 MiB KV cache (the CPU default is 1 GiB, resident from the start): the demo
    model needs little, and a suite that runs half a dozen servers at once must fit a small machine."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BATCHGEN_CPU_KV_CACHE_GIB", "0.0625")
        yield


@pytest.fixture(scope="session")
def live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One real server for the whole session (``base_url``, ``storage_dir``, ``http`` and helpers); its activity
    line every 0.2 s (tests/server/test_metrics_and_logs.py reads it)."""
    with ServerProcess(tmp_path_factory.mktemp("server"), "--log-interval-s", "0.2") as process:
        server = LiveServer(process)
        yield server
        server.http.close()


@pytest.fixture(scope="session")
def server_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., LiveServer]]:
    """Start more servers with their own flags (``factory("--max-queued-requests", "4", api_key="k")``)."""
    started: list[LiveServer] = []

    def factory(*args: str, api_key: str | None = None) -> LiveServer:
        key_args = ("--api-key", api_key) if api_key else ()
        process = ServerProcess(tmp_path_factory.mktemp("server"), *args, *key_args).start()
        started.append(LiveServer(process, api_key=api_key))
        return started[-1]

    yield factory
    for server in started:
        server.http.close()
        server.process.stop()


@pytest.fixture(scope="session")
def keyed_server(server_factory: Callable[..., LiveServer]) -> LiveServer:
    """One server with two API keys (two tenants) for the session; its ``http`` uses ``TENANT_KEYS[0]``."""
    return server_factory("--api-key", TENANT_KEYS[1], api_key=TENANT_KEYS[0])


@pytest.fixture(scope="session")
def lora_adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three LoRA adapters of the demo model made with peft (``lora_helpers.ADAPTERS``), by name."""
    from lora_helpers import make_adapters

    from batchgen.server.engine.loading.demo_model import demo_model_dir

    return make_adapters(demo_model_dir(), tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="session")
def peft_text(lora_adapters: dict[str, Path]) -> Callable[[list[int], int, str | None], str]:
    """``peft_text(prompt, tokens, adapter)``: the text of peft's greedy tokens (``None``: the base), as served."""
    from lora_helpers import peft_reference
    from transformers import AutoTokenizer

    from batchgen.server.engine.loading.demo_model import demo_model_dir

    greedy = peft_reference(demo_model_dir(), lora_adapters)
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir())
    return lambda prompt, tokens, name: tokenizer.decode(greedy(prompt, tokens, name), skip_special_tokens=True)
