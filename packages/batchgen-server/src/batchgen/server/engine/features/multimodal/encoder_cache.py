"""The vision tower's outputs by image content hash, least recently used first out, within a memory budget: the
same picture in 1,000 lines is encoded once while it stays in."""

from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        """0: nothing is kept (each step encodes what it needs)."""
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, key: bytes) -> torch.Tensor | None:
        features = self._entries.get(key)
        if features is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return features

    def put(self, key: bytes, features: torch.Tensor) -> None:
        size = features.numel() * features.element_size()
        if size > self.budget or key in self._entries:
            return
        if features.untyped_storage().nbytes() > size:
            # A view of the whole batch's output (the towers split one tensor): kept as it is, it would hold every
            # other image's rows in memory, uncounted, for as long as it stays.
            features = features.clone()
        while self.bytes + size > self.budget:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()
        self._entries[key] = features
        self.bytes += size

    def held_bytes(self) -> int:
        """The memory the entries hold (their storages): ``bytes`` when no entry is a view of a larger tensor."""
        return sum(features.untyped_storage().nbytes() for features in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)
