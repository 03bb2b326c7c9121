"""Embedding pooling shared by the decoder and the encoder paths: mean over real tokens, then L2 normalization."""

from __future__ import annotations

import torch


def normalized_mean(token_sum: torch.Tensor, num_tokens: int | torch.Tensor) -> torch.Tensor:
    """The L2-normalized mean of hidden states (last dimension) given their sum over ``num_tokens`` tokens."""
    return torch.nn.functional.normalize(token_sum / num_tokens, dim=-1)
