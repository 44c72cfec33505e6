"""WireCounter(timing_only=True), the watchdog's collective timer: calls and seconds without
binding arguments, and byte counters opened beside it still count bytes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks
from robust_plugins.comm import WireCounter
from robust_plugins.comm import wire

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]


def _timing_then_bytes(rank: int, world: int) -> dict:
    t = torch.ones(1000)
    with WireCounter(timing_only=True) as timing:
        dist.all_reduce(t)
        alone = (timing.bytes_sent, sum(timing.calls.values()), wire._count_bytes)
        with WireCounter() as counting:
            dist.all_reduce(t)
            dist.broadcast(t, src=0)
            nested = (counting.bytes_sent, dict(counting.calls), wire._count_bytes)
        after = wire._count_bytes
        dist.all_reduce(t)
    return {"alone": alone, "nested": nested, "after": after, "calls": dict(timing.calls),
            "bytes": timing.bytes_sent, "seconds": timing.seconds}


def test_timing_only_counts_calls_and_time_and_leaves_bytes_to_byte_counters():
    for out in run_ranks(_timing_then_bytes, 2, 60):
        assert out["alone"] == (0, 1, False)  # no argument binding while only timing is open
        # The byte counter beside it sees the bus model: all_reduce 2(W-1)/W x 4000, broadcast 4000.
        assert out["nested"] == (4000 + 4000, {"all_reduce": 1, "broadcast": 1}, True)
        assert out["after"] is False
        assert out["calls"] == {"all_reduce": 3, "broadcast": 1} and out["bytes"] == 0
        assert out["seconds"] > 0


def test_timing_only_refuses_a_group_filter():
    with pytest.raises(ValueError, match="timing_only counts every group"):
        WireCounter(filter_group=object(), timing_only=True)
