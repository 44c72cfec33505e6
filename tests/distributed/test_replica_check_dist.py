"""ReplicaCheck over real gloo groups: 4 ranks as two replica sets (a tensor-parallel size of 2),
agreement per set, the ranks that differ named, and a replica that never answers turned into an
error within the timeout instead of a hang."""

from __future__ import annotations

import pytest

from _dist import run_ranks
from robust_plugins.checkpoint.replicas import ReplicaCheck
from robust_plugins.errors import CheckpointError

pytestmark = pytest.mark.distributed


def _sets(rank: int, world: int) -> dict:
    # Sets {0, 2} and {1, 3}: 0 and 2 hold one shard, 1 and 3 the other (different digests).
    check = ReplicaCheck([rank % 2, rank % 2 + 2], timeout_s=30)
    shard = 1000 + rank % 2
    out = {"ranks": check.ranks, "same": check.agree(shard)}
    # Rank 3 flips a bit: its set names both (no majority of two), the other set still agrees.
    out["flip"] = check.agree(shard ^ (1 << 5) if rank == 3 else shard)
    return out


def test_each_replica_set_agrees_on_its_own_and_a_difference_is_named():
    res = run_ranks(_sets, 4, 120)
    assert [r["ranks"] for r in res] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert all(r["same"] is None for r in res)
    assert res[0]["flip"] is None and res[2]["flip"] is None
    assert res[1]["flip"] == res[3]["flip"] == {1: 1001, 3: 1001 ^ (1 << 5)}


def _silent(rank: int, world: int):
    check = ReplicaCheck(list(range(world)), timeout_s=3)
    if rank == 1:
        return "silent"  # never joins the agreement (a dead or stuck replica)
    try:
        check.agree(7)
    except CheckpointError as exc:
        return str(exc)
    return "agreed"


def test_a_replica_that_does_not_answer_is_an_error_within_the_timeout():
    res = run_ranks(_silent, 2, 120)
    assert res[1] == "silent"
    assert "not every rank answered within 3 s" in res[0] and "replica check" in res[0]
