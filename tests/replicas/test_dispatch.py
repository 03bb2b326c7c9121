"""Dispatch: the least loaded replica, unless the one holding the same first block of prompt tokens in its prefix
cache is at most ``slack`` sequences busier."""

from __future__ import annotations

from batchgen.server.replicas.dispatch import Dispatcher, Load

BLOCK = 4
SHARED = [7, 7, 7, 7]
"""A first block that many prompts share (a system prompt)."""


def test_the_least_loaded_replica_takes_a_request() -> None:
    dispatcher = Dispatcher(BLOCK, slack=2)
    assert dispatcher.choose([1, 2], {0: Load(3, 10), 1: Load(1, 10), 2: Load(2, 10)}) == 1
    assert dispatcher.choose([1, 2], {0: Load(1, 10), 1: Load(1, 50)}) == 1  # a tie: more free KV blocks wins
    assert dispatcher.choose([1, 2], {0: Load(1, 10), 1: Load(1, 10)}) == 0
    assert dispatcher.choose([1, 2], {}) is None  # none running: the pool holds the request


def test_a_shared_first_block_stays_on_its_replica_while_that_is_cheap() -> None:
    dispatcher = Dispatcher(BLOCK, slack=2)
    assert dispatcher.choose([*SHARED, 1], {0: Load(0, 10), 1: Load(0, 10)}) == 0
    # Replica 0 holds the block: it keeps getting such requests while at most 2 sequences busier than the least.
    assert dispatcher.choose([*SHARED, 2], {0: Load(2, 10), 1: Load(0, 10)}) == 0
    assert dispatcher.choose([*SHARED, 3, 4], {0: Load(3, 10), 1: Load(0, 10)}) == 1  # too busy: balance wins
    assert dispatcher.choose([*SHARED, 5], {0: Load(1, 10), 1: Load(1, 10)}) == 1  # and the block follows
    # Another first block, or a prompt without a whole block, goes by load alone.
    assert dispatcher.choose([8, 8, 8, 8, 1], {0: Load(0, 10), 1: Load(1, 10)}) == 0
    assert dispatcher.choose([7, 7, 7], {0: Load(0, 10), 1: Load(1, 10)}) == 0


def test_a_replica_that_stopped_running_loses_its_blocks() -> None:
    dispatcher = Dispatcher(BLOCK, slack=2)
    assert dispatcher.choose([*SHARED, 1], {0: Load(0, 10), 1: Load(1, 10)}) == 0
    assert dispatcher.choose([*SHARED, 1], {1: Load(1, 10), 2: Load(0, 10)}) == 2  # replica 0 is not running
    assert dispatcher.choose([*SHARED, 1], {0: Load(0, 10), 1: Load(0, 10), 2: Load(1, 10)}) == 2
