"""The flight recorder read through torch's worker server while a rank is blocked inside a gloo
collective (the C++ server and the counters NCCL ranks have too): the monitor's hang evidence on NCCL."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks
from robust_plugins.watchdog import detect, flight

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]


def _blocked_rank_answers(rank: int, world: int, run_dir: str) -> dict:
    path = flight.serve(run_dir, rank)
    paths = [None] * world
    dist.all_gather_object(paths, path)
    t = torch.ones(4)
    for _ in range(3):
        dist.all_reduce(t)
    if rank == 0:
        dist.all_reduce(t)  # blocks until rank 1 joins, after it read both recorders
        return {}
    time.sleep(1.0)  # rank 0 is inside its all-reduce by now
    t0 = time.monotonic()
    dumps = flight.collect(dict(enumerate(paths)))
    took = time.monotonic() - t0
    views = flight.views(dumps)
    where = detect.localize_by_sequence(flight.from_json(views))
    dist.all_reduce(t)  # release rank 0
    return {"suspects": where.suspects if where else None, "reason": where.reason if where else "",
            "took": took, "dumps": dumps, "views": views}


def test_worker_server_answers_while_the_rank_is_blocked_in_a_collective(tmp_path):
    _, out = run_ranks(_blocked_rank_answers, 2, 90, str(tmp_path))
    assert out["dumps"][0] is not None and out["dumps"][1] is not None, out
    # torch's real dump, read as the monitor reads it: the default group by its global name
    # (gloo's recorder keeps no member list; NCCL's does), rank 0 one collective ahead and blocked
    # in it (its entry not retired), rank 1 behind with everything done (gloo's entries stay
    # "scheduled" and only retire).
    v0, v1 = out["views"][0]["gloo:0"], out["views"][1]["gloo:0"]
    assert v0["enqueued"] == v1["enqueued"] + 1 == v0["completed"] + 1, out["views"]
    assert v1["completed"] == v1["enqueued"] and not v1["pending_p2p"], out["views"]
    assert out["suspects"] == [1], out
    assert out["took"] < 5.0
