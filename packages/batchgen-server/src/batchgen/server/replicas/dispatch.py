"""Which replica takes a request: the least loaded one, unless the replica that took the last request starting with
the same block of prompt tokens is not much busier; its prefix cache holds that block, and only helps there."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

AFFINITY_ENTRIES = 65_536
"""First blocks remembered (least recently used forgotten first): a few MB at most."""


@dataclass(frozen=True, slots=True)
class Load:
    assigned: int
    """Sequences dispatched to the replica and not answered: counted by the pool, so exact at once."""
    kv_blocks_free: int
    """As the replica last reported: breaks ties."""


class Dispatcher:
    def __init__(self, block_size: int, slack: int) -> None:
        self.block_size = block_size
        self.slack = slack
        """How many more sequences than the least loaded replica a replica may hold and still get a request whose
        first block it has cached."""
        self._affinity: OrderedDict[int, int] = OrderedDict()
        """Hash of a first block of prompt tokens -> the replica that last took such a request."""

    def choose(self, prompt: Sequence[int], loads: Mapping[int, Load]) -> int | None:
        """The replica (a key of ``loads``, the replicas that take work) for a request with ``prompt``; ``None``
        when no replica takes work."""
        if not loads:
            return None
        least = min(loads, key=lambda index: (loads[index].assigned, -loads[index].kv_blocks_free, index))
        if len(prompt) < self.block_size:  # no full block: nothing the prefix cache could reuse
            return least
        key = hash(tuple(prompt[: self.block_size]))
        preferred = self._affinity.get(key)
        if (
            preferred is not None
            and preferred in loads
            and loads[preferred].assigned <= loads[least].assigned + self.slack
        ):
            chosen = preferred
        else:
            chosen = least
        self._affinity[key] = chosen
        self._affinity.move_to_end(key)
        if len(self._affinity) > AFFINITY_ENTRIES:
            self._affinity.popitem(last=False)
        return chosen
