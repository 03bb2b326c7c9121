"""The prepacked output head computes what ``nn.Linear`` does, on every shape the head sees."""

from __future__ import annotations

import pytest
import torch

from batchgen.server.engine.fast_forward import PrepackedLinear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_the_prepacked_linear_equals_the_linear(dtype: torch.dtype, bias: bool) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 1000, bias=bias).to(dtype)
    packed = PrepackedLinear.of(linear)
    if packed is None:
        assert dtype != torch.float32, "float32 packs on every CPU with oneDNN"
        pytest.skip(f"oneDNN does not pack {dtype} on this CPU")
    hidden = torch.randn(1, 70, 96, dtype=dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    with torch.no_grad():
        # Every row (a prefill), a few (the sampled rows, gathered), and a strided view (a slice of the rows).
        for rows in (hidden, hidden[:, [3, 40, 69]], hidden[:, ::7], hidden[:, :1], hidden[:, :0]):
            expected = linear(rows)
            actual = packed(rows)
            assert actual.shape == expected.shape and actual.dtype == expected.dtype
            torch.testing.assert_close(actual, expected, rtol=tolerance, atol=tolerance)


def test_only_cpu_linears_of_a_packable_dtype_are_packed() -> None:
    assert PrepackedLinear.of(torch.nn.Linear(8, 8).double()) is None
    assert PrepackedLinear.of(torch.nn.Embedding(8, 8)) is None
    assert PrepackedLinear.of(None) is None
