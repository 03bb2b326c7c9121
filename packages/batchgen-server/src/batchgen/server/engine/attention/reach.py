"""How far back a model's attention chooses what it sees: the mechanisms a short prompt never exercises.

A sliding window, a sparse top-k selection (DSA's ``index_topk``), a chunked attention or a compression stride only
changes what a query sees once the context is longer than it. The load-time self-check (``self_check.py``) runs a
prompt past the longest of them, within a time budget, or refuses the model naming the one it cannot reach: a model
served past a length its check never saw could be served wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Mechanism:
    what: str
    """What it is, as a refusal names it: ``its sliding window of 4096 tokens``."""
    tokens: int
    """A context of more tokens than this exercises it."""


def compression(text_config: Any) -> str | None:
    """The compressed attention ``text_config`` declares (DeepSeek-V4's), named for a refusal; ``None`` if none."""
    rates = getattr(text_config, "compress_rates", None)
    if isinstance(rates, dict) and rates:
        layers = ", ".join(f"{name} one entry per {rate} tokens" for name, rate in rates.items())
        return f"its compressed attention ({layers})"
    rate = getattr(text_config, "compress_ratio", None)
    return f"its compressed attention (one entry per {rate} tokens)" if isinstance(rate, int) and rate > 1 else None


def mechanisms(text_config: Any, windows: set[int | None]) -> list[Mechanism]:
    """What ``text_config`` declares and the layers asked of attention when the engine probed them (``windows``:
    each layer's sliding window, ``None`` for full attention), longest last."""
    found = [Mechanism(f"its sliding window of {window} tokens", window) for window in windows if window]
    topk = getattr(text_config, "index_topk", None)
    if isinstance(topk, int) and topk > 0:
        found.append(Mechanism(f"its sparse attention's top-{topk} token selection (index_topk)", topk))
    chunk = getattr(text_config, "attention_chunk_size", None)
    if isinstance(chunk, int) and chunk > 0:
        found.append(Mechanism(f"its chunked attention of {chunk} tokens (attention_chunk_size)", chunk))
    rates = getattr(text_config, "compress_rates", None) or getattr(text_config, "compress_ratio", None)
    strides = list(rates.values()) if isinstance(rates, dict) else rates if isinstance(rates, list) else [rates]
    for stride in {s for s in strides if isinstance(s, int) and s > 1}:
        found.append(Mechanism(f"its compressed attention's stride of {stride} tokens (compress_rates)", 2 * stride))
    return sorted(found, key=lambda mechanism: mechanism.tokens)
