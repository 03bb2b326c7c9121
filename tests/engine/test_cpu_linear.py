"""The packed linear (``cpu_linear.py``) computes what ``nn.Linear`` does, on every shape a step gives it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from batchgen.server.engine.ops import cpu_linear, native


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "features",
    [(1000, 96), (33, 1030), (64, 7), (5, 40)],
    ids=["a head: the last panel partly filled", "k in three slices", "whole panels", "one partial panel"],
)
def test_the_packed_linear_equals_the_linear(bias: bool, threads: int, features: tuple[int, int]) -> None:
    torch.manual_seed(0)
    out_features, in_features = features
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    forward = cpu_linear.forward_of(linear)
    assert forward is not None
    hidden = torch.randn(1, 300, in_features)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            # Decodes of every row count the kernel takes and either side of it (MKL's), the sampled rows gathered,
            # a strided view, and none.
            for rows in (
                *(hidden[:, :n] for n in (0, 1, 2, 13, 64, 65, 300)),
                hidden[:, [3, 40]],
                hidden[:, ::7],
            ):
                expected = linear.__class__.forward(linear, rows)
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
                    actual = forward(rows)
                # The kernel's row counts are ROWS exactly: a silent fallback to MKL fails, as does one missed.
                on_mkl = any(event.name == "aten::linear" for event in profile.events())
                assert on_mkl == (rows.shape[1] not in cpu_linear.ROWS)
                assert actual.shape == expected.shape and actual.dtype == expected.dtype
                torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(before)


def test_the_packed_linear_compiles_into_a_graph() -> None:
    """Inside a compiled function the operator traces without a graph break (``fullgraph``), at several row counts."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(40, 70)
    linear.forward = cpu_linear.forward_of(linear)  # type: ignore[method-assign]
    compiled = torch.compile(lambda x: linear(x).relu(), dynamic=True, fullgraph=True)
    with torch.no_grad():
        for rows in (5, 9, 200):
            x = torch.randn(rows, 40)
            torch.testing.assert_close(compiled(x), torch.nn.functional.linear(x, linear.weight, linear.bias).relu())


def test_only_float32_cpu_linears_are_packed() -> None:
    assert not cpu_linear.supports(torch.nn.Linear(0, 8))
    assert not cpu_linear.supports(torch.nn.Linear(8, 8).double())
    assert not cpu_linear.supports(torch.nn.Linear(8, 8).bfloat16())
    assert not cpu_linear.supports(torch.nn.Embedding(8, 8))
    assert not cpu_linear.supports(None)
    assert cpu_linear.forward_of(torch.nn.Embedding(8, 8)) is None


def test_a_linear_with_someone_elses_forward_is_left_alone_and_a_packed_one_is_shared() -> None:
    hooked = torch.nn.Linear(8, 8)
    hooked.forward = lambda x: x  # type: ignore[method-assign]  # e.g. accelerate's hooks
    assert cpu_linear.forward_of(hooked) is None
    packed = torch.nn.Linear(8, 8)
    forward = cpu_linear.forward_of(packed)
    packed.forward = forward  # type: ignore[assignment]  # installed, as the fast forward does
    assert cpu_linear.forward_of(packed) is forward  # a second engine on the model
    cpu_linear.unpack(packed)
    assert "panels" not in dict(packed.named_buffers())


def test_the_operators_check_their_inputs() -> None:
    """What the kernel cannot read is refused with the reason (an error from C++), not read."""
    weight = torch.randn(8, 16)
    panels = cpu_linear.pack(weight)
    x = torch.randn(4, 16)
    for message, call in {
        "x's last dimension must be the weight's 16, not 15": lambda: cpu_linear.linear(x[:, 1:], weight, panels, None),
        "the bias must be a contiguous float32 vector of 8": lambda: cpu_linear.linear(
            x, weight, panels, torch.zeros(8, dtype=torch.float64)
        ),
        "the panels must be contiguous float32": lambda: cpu_linear.linear(x, weight, panels.double(), None),
        "the weight must be a 2-d float32 tensor, not 2-d Double": lambda: cpu_linear.pack(weight.double()),
    }.items():
        with pytest.raises(RuntimeError, match=message):
            call()


def test_the_operators_pass_torchs_checks() -> None:
    """``opcheck``: the schemas say what the operators do, and panel_linear's meta kernel what torch.compile traces
    (pack_panels runs once a linear, never traced)."""
    weight, bias = torch.randn(70, 40), torch.randn(70)
    panels = cpu_linear.pack(weight)
    for x in (torch.randn(5, 40), torch.randn(2, 3, 40), torch.randn(100, 40)):
        torch.library.opcheck(torch.ops.batchgen.panel_linear.default, (x, weight, panels, bias))
    torch.library.opcheck(torch.ops.batchgen.pack_panels.default, (weight,), test_utils="test_schema")


def test_without_a_compiler_the_linears_keep_their_own_forward(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A failed build is said once and not tried again by the process; a library built before is loaded without a
    compiler."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    native._loaded.cache_clear()
    cpu_linear._warn_once.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert cpu_linear.forward_of(torch.nn.Linear(8, 8)) is None
        assert "failed to build cpu_linear.cpp" in caplog.text
        with monkeypatch.context() as patch:
            patch.setattr(native.cpp_extension, "load", None)
            with pytest.raises(native.Unavailable, match=r"failed to build cpu_linear\.cpp"):
                cpu_linear.pack(torch.randn(8, 8))
    finally:
        native._loaded.cache_clear()  # the next test builds (or finds) the real one
    monkeypatch.undo()
    native.load(cpu_linear.SOURCE)  # built before this test, or now
    native._loaded.cache_clear()
    monkeypatch.setattr(native.cpp_extension, "load", None)
    native.load(cpu_linear.SOURCE)
