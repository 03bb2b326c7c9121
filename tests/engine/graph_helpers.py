"""A stand-in for a CUDA graph, for the tests of the graph path on CPU (the ``graphs_on_cpu`` fixture)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from batchgen.server.engine.runner.cuda_graphs import Graph


class Rerun:
    """Stands in for a CUDA graph where none can be had: its "replay" runs the captured forward again, over the same
    static tensors, into the same output tensor."""

    replays = 0

    def capture(self, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        self.forward = forward
        self.output = forward()
        return self.output

    def replay(self) -> None:
        Rerun.replays += 1
        self.output.copy_(self.forward())

    @classmethod
    def maker(cls) -> Callable[[], Graph]:
        return cls
