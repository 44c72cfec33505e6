"""A node lost while a peer copy is still in flight: 4 gloo ranks as 2 nodes of 2, snapshots of
steps 1..K+1 with the peer backup wired as the DeepSpeed and megatron-core bindings wire it, and
rank 0's copy of step K held back on its snapshot thread (a slow link). The training threads go
on: the peer send never delays a snapshot. With node 0 (ranks 0 and 1) gone, what node 1 keeps
must still hold one step for every rank, at most two steps old.

This is the race that failed ``test_a_lost_node_restores_from_the_peers_on_the_other_node`` with
``ROBUST_TEST_SEED=520057743`` (rank 0: [12]; ranks 2, 3: [14, 13]), made deterministic: before
the agreed step was kept, node 1 held ranks 0 and 1 at K-1, K-2 and itself at K+1, K."""

from __future__ import annotations

import pytest

from _dist import run_ranks

pytestmark = pytest.mark.distributed

K = 5


def _train(rank: int, world: int, root: str) -> dict:
    import threading

    import torch
    import torch.distributed as dist

    from robust_plugins.checkpoint.memory import SnapshotStore
    from robust_plugins.checkpoint.peer import PeerBackup, plan_peers

    holders = plan_peers(["node0", "node0", "node1", "node1"])
    peers = PeerBackup("lag", rank, holders, dist.new_group(backend="gloo"), root=root, timeout_s=60)
    release = threading.Event()

    def after_commit(_index, slot):
        if rank == 0 and slot.header().step == K:
            release.wait(60)  # rank 0's copy of step K is slow to leave
        store.keep_step = peers.exchange(slot)

    store = SnapshotStore("lag", rank, world, root=root, after_commit=after_commit, n_slots=3)
    for step in range(1, K + 2):
        dist.barrier()  # the training step's collectives: every rank takes each step together
        store.save(step, {"w": torch.full((64,), float(step + 100 * rank))})
        store.settle()  # committed, as before the next optimizer step
    # Node 0 is lost now: what does node 1 hold? (read while rank 0's copy of K is in flight)
    report = {"own": [[s.step, s.slot] for s in store.own_snapshots()],
              "held": {str(peers.source): [[s.step, s.slot] for s in peers.held_snapshots(world)]}}
    reports = [None] * world
    dist.all_gather_object(reports, report)
    release.set()
    store.flush(60)
    out = {"holders": holders, "reports": reports, "agreed": peers.agreed_step,
           "own_after": sorted(s.step for s in store.own_snapshots())}
    store.close(remove=True)
    peers.close(remove=True)
    return out


def test_a_node_lost_while_a_copy_is_in_flight_still_has_a_common_step(tmp_path):
    from robust_plugins.checkpoint.restore import PEER, plan_restore

    res = run_ranks(_train, 4, 120, str(tmp_path))
    assert res[0]["holders"] == [2, 3, 0, 1]
    reports = res[0]["reports"]
    lost = [{"own": [], "held": {}}, {"own": [], "held": {}}]
    plan = plan_restore(lost + reports[2:])
    assert plan.step is not None, (plan.reason, reports)
    # K-1: every copy of it was agreed before anyone snapshotted K+1; two steps older than the
    # newest, one older than the copy in flight.
    assert plan.step == K - 1, reports
    assert [s[0] for s in plan.sources[:2]] == [PEER, PEER]
    # Once the copy landed, K and K+1 were agreed in turn; each rank keeps three own slots.
    assert {r["agreed"] for r in res} == {K + 1}
    assert all(r["own_after"] == [K - 1, K, K + 1] for r in res)
