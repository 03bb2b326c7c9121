"""Pooling: a prompt's last hidden states made into one vector, as its model's pooling says (``pooling_spec.py``):
the mean over its tokens, its last token's or its first's; then the model's head where it has one (a classifier's
score layer, a reranker's "yes" minus "no" rows of its LM head) and, for an embedding model, L2 normalization.

A decoder's prompt runs in chunks (chunked prefill, a prefix from the cache): each chunk's hidden states are folded
into what the request holds (``add``), and the vector is made once the prompt is computed (``result``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ModelNotSupported
from ..loading.pooling_spec import PoolingMode, PoolingSpec


@dataclass(frozen=True, slots=True)
class Head:
    """A linear head on the pooled state: ``weight`` ``[outputs, hidden]``, an optional bias."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None

    def __call__(self, pooled: torch.Tensor) -> torch.Tensor:
        # In the model's dtype, as its own forward runs the head, then float32.
        return torch.nn.functional.linear(pooled.to(self.weight.dtype), self.weight, self.bias).float()


@dataclass(frozen=True, slots=True)
class Pooler:
    mode: PoolingMode = "mean"
    normalize: bool = True
    head: Head | None = None

    def add(self, pooled: torch.Tensor | None, hidden: torch.Tensor, start: int) -> torch.Tensor | None:
        """What a request holds after a chunk of its prompt: ``hidden`` ``[tokens, hidden]`` from position ``start``."""
        if self.mode == "mean":
            chunk = hidden.float().sum(dim=0)
            return chunk if pooled is None else pooled + chunk
        if self.mode == "last":
            return hidden[-1]
        return hidden[0] if start == 0 else pooled

    def result(self, pooled: torch.Tensor, num_tokens: int) -> list[float]:
        """The vector of a computed prompt of ``num_tokens`` tokens."""
        vector = pooled / num_tokens if self.mode == "mean" else pooled.float()
        if self.head is not None:
            vector = self.head(vector)
        if self.normalize:
            vector = torch.nn.functional.normalize(vector, dim=-1)
        values: list[float] = vector.tolist()
        return values


def pooler_for(spec: PoolingSpec, model: Any, tokenizer: Any) -> Pooler:
    """The pooler of a loaded model served as ``spec`` says: its head taken from the model's own weights."""
    head = None
    if spec.kind in ("classify", "reward"):
        layer = getattr(model, "score", None) or getattr(model, "classifier", None)
        if not isinstance(layer, torch.nn.Linear):
            raise ModelNotSupported(
                spec.architecture, "its classifier head is not one linear layer on the pooled state"
            )
        head = Head(layer.weight, layer.bias)
    elif spec.kind == "yes_no":
        ids = [tokenizer.convert_tokens_to_ids(token) for token in ("yes", "no")]
        if None in ids or tokenizer.unk_token_id in ids:
            raise ModelNotSupported(spec.architecture, "--task score needs 'yes' and 'no' tokens in its vocabulary")
        rows = model.get_output_embeddings().weight
        head = Head((rows[ids[0]] - rows[ids[1]]).unsqueeze(0))  # softmax over (no, yes) picks yes: sigmoid(yes - no)
    return Pooler(spec.mode, spec.normalize, head)
