"""The Gated DeltaNet fast path (``engine/features/state/gdn.py``, ``gdn.cpp``): its kernels against transformers' torch
functions on random inputs, and its step of a whole packed row (fresh chunks, continued chunks, decodes, checkpoints
inside a chunk) against the layer's own forward run sequence by sequence. The engine through it against ``generate``
is ``test_hybrid.py``'s (Qwen3.5, Qwen3.5-MoE, Qwen3-Next)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3_5TextConfig, Qwen3NextConfig
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from batchgen.server.engine.features.state import gdn
from batchgen.server.engine.features.state.discovery import StateLayer, StateShape
from batchgen.server.engine.features.state.facade import StateFacade, StateKey
from batchgen.server.engine.ops import native

TOLERANCE = 2e-5

SEGMENTS = [  # (first, end, slot, fresh, checkpoint): what StateStep.segments makes of a step
    (0, 1, 1, 0, -1),  # a decode
    (1, 5, 0, 1, 4),  # a prompt's first 4 tokens, checkpointed to slot 4...
    (5, 12, 0, 0, -1),  # ...and the rest of its chunk
    (12, 13, 3, 0, 5),  # a decode that completes a block
    (13, 18, 2, 0, -1),  # a continued chunk
]
SLOTS = 6


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    native.load(gdn.SOURCE)


def _random_states(conv: torch.Tensor, recurrent: torch.Tensor) -> None:
    generator = torch.Generator().manual_seed(1)
    conv.copy_(torch.randn(conv.shape, generator=generator))
    recurrent.copy_(torch.randn(recurrent.shape, generator=generator) * 0.1)


@pytest.mark.parametrize(("dk", "dv"), [(16, 16), (32, 64), (128, 128)])  # any; 64 and 128 compiled as constants
def test_the_delta_rule_is_transformers_on_every_segment(dk: int, dv: int) -> None:
    """``gdn_rule`` against ``torch_chunk_gated_delta_rule`` (a prompt piece, from zero or from a state) and
    ``torch_recurrent_gated_delta_rule`` (a decode), two value heads a key head, in place on the cache."""
    torch.manual_seed(0)
    rows, k_heads, v_heads = SEGMENTS[-1][1], 2, 4
    q, k = torch.randn(rows, k_heads, dk), torch.randn(rows, k_heads, dk)
    v, g, beta = torch.randn(rows, v_heads, dv), -torch.rand(rows, v_heads) * 2, torch.rand(rows, v_heads)
    state = torch.randn(SLOTS, v_heads, dk, dv) * 0.1
    before = state.clone()
    out = torch.ops.batchgen.gdn_rule(q, k, v, g, beta, state, torch.tensor(SEGMENTS))
    expected = before.clone()
    for first, end, slot, fresh, checkpoint in SEGMENTS:
        rule = qwen3_5.torch_recurrent_gated_delta_rule if end - first == 1 else qwen3_5.torch_chunk_gated_delta_rule
        o, final = rule(
            *(x[None, first:end] for x in (q, k, v, g, beta)),
            initial_state=None if fresh else expected[slot : slot + 1],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        torch.testing.assert_close(out[first:end], o[0], atol=TOLERANCE, rtol=0)
        expected[slot] = final[0]
        if checkpoint >= 0:
            expected[checkpoint] = final[0]
    torch.testing.assert_close(state, expected, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_convolution_is_transformers_on_every_segment(dtype: torch.dtype) -> None:
    """``gdn_conv`` (then SiLU, as the caller applies it) against ``causal_conv1d_fn`` (from zero, or over the kept
    columns) and ``causal_conv1d_update`` (a decode), and the columns each slot keeps after."""
    torch.manual_seed(0)
    rows, channels, kernel = SEGMENTS[-1][1], 24, 4
    x = torch.randn(rows, channels, dtype=dtype)
    weight, bias = torch.randn(channels, kernel, dtype=dtype), torch.randn(channels, dtype=dtype)
    state = torch.randn(SLOTS, channels, kernel, dtype=dtype)
    expected = state.clone()
    out = F.silu(torch.ops.batchgen.gdn_conv(x, state, weight.float(), bias.float(), torch.tensor(SEGMENTS)))
    for first, end, slot, fresh, checkpoint in SEGMENTS:
        piece = x[first:end].T[None]
        if end - first == 1 and not fresh:
            kept = expected[slot : slot + 1].clone()
            o = qwen3_5.causal_conv1d_update(piece, kept, weight, bias, "silu")
        else:
            kept = torch.zeros(1, channels, kernel, dtype=dtype) if fresh else expected[slot : slot + 1]
            full = torch.cat([kept, piece], dim=-1)
            o = qwen3_5.causal_conv1d_fn(full, weight, bias, activation="silu")[..., -piece.shape[-1] :]
            kept = full[..., -kernel:]
        bf16 = {"atol": 1e-2, "rtol": 2**-7}  # a bf16 ulp: summed in float32 here
        tolerance = {"atol": TOLERANCE, "rtol": 0} if dtype == torch.float32 else bf16
        torch.testing.assert_close(out[first:end], o[0].T, **tolerance)
        expected[slot] = kept[0]
        if checkpoint >= 0:
            expected[checkpoint] = kept[0]
    torch.testing.assert_close(state, expected, atol=0, rtol=0)


class _Given(StateFacade):
    """The layer's own cache interface over given states (a continuing call), as the engine's generic path hands it."""

    def __init__(self, states: dict[StateKey, torch.Tensor] | None) -> None:
        super().__init__(fresh=states is None)
        self.given = states or {}

    def stored(self, key: StateKey) -> torch.Tensor | None:
        return self.given[key].clone()


def _layer(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    sizes: dict[str, Any] = {
        "hidden_size": 32,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "num_hidden_layers": 1,
        "layer_types": ["linear_attention"],
    }
    module = (
        qwen3_5.Qwen3_5GatedDeltaNet(Qwen3_5TextConfig(**sizes), 0)
        if name == "qwen3_5"
        else Qwen3NextGatedDeltaNet(Qwen3NextConfig(**sizes), 0)
    )
    with torch.no_grad():  # transformers' init leaves the norm and A_log plain: give them something to get wrong
        module.norm.weight.uniform_(0.5, 1.5)
        module.dt_bias.uniform_(-1, 1)
    return module.eval()


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next"])
def test_a_packed_step_is_the_layers_own_forward_sequence_by_sequence(name: str) -> None:
    module = _layer(name)
    conv_key, recurrent_key = (0, "conv", 0), (0, "recurrent", 0)
    conv = torch.zeros(SLOTS, module.conv_dim, module.conv_kernel_size)
    recurrent = torch.zeros(SLOTS, module.num_v_heads, module.head_k_dim, module.head_v_dim)
    _random_states(conv, recurrent)
    layer = StateLayer(module, [StateShape(key, (), torch.float32, conv.device) for key in (conv_key, recurrent_key)])
    step = gdn.fast_path(layer, {conv_key: conv, recurrent_key: recurrent})
    assert isinstance(step, gdn.GatedDeltaNet)
    hidden = torch.randn(1, SEGMENTS[-1][1], 32)
    expected = {key: tensor.clone() for key, tensor in ((conv_key, conv), (recurrent_key, recurrent))}
    with torch.no_grad():
        out = step.run(hidden, torch.tensor(SEGMENTS))
        for first, end, slot, fresh, checkpoint in SEGMENTS:
            facade = _Given(None if fresh else {key: value[slot : slot + 1] for key, value in expected.items()})
            torch.testing.assert_close(
                out[:, first:end], module(hidden[:, first:end], cache=facade), atol=TOLERANCE, rtol=0
            )
            for key, value in expected.items():
                value[slot] = facade.current[key][0]
                if checkpoint >= 0:
                    value[checkpoint] = facade.current[key][0]
    torch.testing.assert_close(conv, expected[conv_key], atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(recurrent, expected[recurrent_key], atol=TOLERANCE, rtol=0)


def test_without_the_kernels_the_layer_keeps_its_own_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """No compiler (or a failed build): the generic path, and the reason said (``EngineStats.fast_paths``)."""
    module = _layer("qwen3_5")
    tensors = {
        (0, "conv", 0): torch.zeros(2, module.conv_dim, 4),
        (0, "recurrent", 0): torch.zeros(2, module.num_v_heads, 16, 16),
    }
    layer = StateLayer(module, [StateShape(key, (), torch.float32, torch.device("cpu")) for key in tensors])

    def unavailable(source: Any) -> None:
        raise native.Unavailable("no C++ compiler: c++ not found")

    monkeypatch.setattr(native, "load", unavailable)
    assert gdn.fast_path(layer, tensors) == "no C++ compiler: c++ not found"
    tensors[(0, "recurrent", 0)] = tensors[(0, "recurrent", 0)].bfloat16()  # a state the kernel does not keep
    assert "other states" in str(gdn.fast_path(layer, tensors))
