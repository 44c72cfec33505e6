"""WireCounter(timing_only=True), the watchdog's collective timer: calls and seconds without
binding arguments, and byte counters opened beside it still count bytes."""

from __future__ import annotations

import time

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


LATE_S = 0.6


def _async_timed_to_completion(rank: int, world: int) -> dict:
    # Rank 1 joins late: rank 0's async all-reduce (and its coalesced pair) takes ~LATE_S to
    # complete; its launch takes microseconds. The counter must count the former, without the
    # caller reporting its wait.
    from torch.distributed.distributed_c10d import _coalescing_manager

    t = torch.ones(1000)
    out = {}
    for how in ("async", "coalesced"):
        dist.barrier()
        with WireCounter(timing_only=True) as wc:
            if rank == 1:
                time.sleep(LATE_S)
            if how == "async":
                work = dist.all_reduce(t, async_op=True)
            else:
                with _coalescing_manager(async_ops=True) as cm:
                    dist.all_reduce(t[:500], async_op=True)
                    dist.all_reduce(t[500:], async_op=True)
                work = cm
            launched = wc.settled_seconds()
            work.wait()
            deadline = time.monotonic() + 5  # the future's callback runs on gloo's thread
            while wc.settled_seconds() <= launched and time.monotonic() < deadline:
                time.sleep(0.01)
        out[how] = {"launch": launched, "total": wc.seconds, "calls": sum(wc.calls.values())}
    return out


@pytest.mark.timeout(90)
def test_async_and_coalesced_collectives_are_timed_to_their_completion():
    rank0 = run_ranks(_async_timed_to_completion, 2, 60)[0]
    for how, calls in (("async", 1), ("coalesced", 2)):
        r = rank0[how]
        assert r["calls"] == calls, rank0
        assert r["launch"] < 0.2 * LATE_S, rank0  # the launch returns at once
        assert r["total"] >= 0.7 * LATE_S, rank0  # timed until the late peer joined
