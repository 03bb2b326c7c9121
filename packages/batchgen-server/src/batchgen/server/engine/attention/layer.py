"""What one attention call asks for, read from the keyword arguments transformers hands the attention function.

Every keyword is either honoured (scale, sliding window, logit soft-cap, attention sinks), known to be irrelevant to
attention (``position_ids``, ``use_cache``, ...), or refused: the model is then rejected at load (the engine probes
every layer once when it starts), never served with an attention it does not actually compute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

IRRELEVANT = frozenset(
    {
        "position_ids", "use_cache", "output_attentions", "output_router_logits", "output_hidden_states", "return_dict",
        "logits_to_keep",  # LLaVA-OneVision hands it to its language model too; only the head slices by it
    }
)  # fmt: skip
"""Keywords the layers pass along that do not change what attention computes."""


class SelectionMask:
    """The mask a DSA layer indexes (``attention_mask[:, 0, :, :]``) and passes on, in the engine's forwards: it
    stands for a mask the engine does not build (``selection.py``)."""

    def __getitem__(self, item: Any) -> SelectionMask:
        return self

    def __repr__(self) -> str:
        return "SELECTION"


SELECTION = SelectionMask()


class AttentionRefused(Exception):
    """An attention call asks for something this engine does not compute (the message says what)."""


@dataclass(frozen=True, slots=True)
class LayerAttention:
    scale: float | None
    """Multiplies ``q . k`` (``None``: ``head_dim ** -0.5``)."""
    window: int | None
    """Sliding window: a query at position ``p`` sees keys at ``p - window < position <= p`` (transformers' rule)."""
    softcap: float | None
    """Attention logit soft-capping: ``tanh(score / cap) * cap`` before the mask and softmax (Gemma 2)."""
    sinks: torch.Tensor | None
    """Per-head attention sink logits (gpt-oss): an extra softmax column that takes mass and gives no value."""

    @property
    def needs_explicit_scores(self) -> bool:
        """Soft-capping and sinks change the scores or the softmax itself: SDPA kernels cannot express them."""
        return self.softcap is not None or self.sinks is not None

    @classmethod
    def of(cls, module: torch.nn.Module, attention_mask: object, kwargs: dict[str, Any]) -> LayerAttention:
        """What the call asks for; ``attention_mask`` may be the engine's DSA stand-in (``selection.py``), whose
        layers hand their selection over as ``indices`` (``selected``)."""
        sparse = attention_mask is SELECTION
        if attention_mask is not None and not sparse:
            raise AttentionRefused("its layers build their own attention mask (e.g. ALiBi or a custom bias)")
        if kwargs.get("is_causal", getattr(module, "is_causal", True)) is False:
            raise AttentionRefused("its attention is bidirectional, not causal")
        for name, value in kwargs.items():
            if name in IRRELEVANT or name in {"scaling", "sliding_window", "softcap", "s_aux", "dropout", "is_causal"}:
                continue
            if sparse and name == "indices":
                continue
            if value is not None and value is not False:
                raise AttentionRefused(
                    f"its attention is called with `{name}`, which batchgen's attention does not apply"
                )
        window = kwargs.get("sliding_window")
        softcap = kwargs.get("softcap")
        return cls(
            scale=kwargs.get("scaling"),
            window=int(window) if window else None,
            softcap=float(softcap) if softcap else None,
            sinks=kwargs.get("s_aux"),
        )
