"""Engine knobs that reach past the engine: the process's torch threads."""

from __future__ import annotations

from collections.abc import Callable

import torch

from batchgen.server.cli import build_parser, settings_from_args
from batchgen.server.engine import LLMEngine


def test_torch_threads_flag_default_and_effect(make_engine: Callable[..., LLMEngine]) -> None:
    parse = build_parser().parse_args
    assert settings_from_args(parse(["serve"])).engine.torch_threads is None  # torch's own default: every core
    run_batch = parse(["run-batch", "-i", "in", "-o", "out", "--torch-threads", "2"])
    assert settings_from_args(run_batch).engine.torch_threads == 2

    before = torch.get_num_threads()
    try:
        make_engine()  # unset: leaves the process's setting alone
        assert torch.get_num_threads() == before
        make_engine(torch_threads=before + 1)
        assert torch.get_num_threads() == before + 1
    finally:
        torch.set_num_threads(before)
