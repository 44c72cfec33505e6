"""Hang blame that holds on NCCL: the verdict from every node's flight recorder, stacks only as support.

The dumps below are in the layout of torch's ``dump_nccl_trace_json`` (``pg_config``, ``pg_status``
with string counters keyed by the per-process ``pg_id``, one entry per collective with
``process_group: [name, desc]``, ``collective_seq_id``, ``p2p_seq_id``, ``profiling_name`` such as
``nccl:all_reduce`` / ``nccl:send 0->1`` and ``state``). The ``pg_id`` of one group differs
between ranks on purpose (NCCL numbers only the groups a rank is a member of), so a verdict keyed
by it would compare unrelated groups. The healthy ranks' stacks are what NCCL ranks show while
they wait for a hung peer: ``loss.item()`` and ``torch.cuda.synchronize`` (outside any collective).
"""

from __future__ import annotations

import datetime
import threading

import pytest
import torch.distributed as dist

from robust_plugins.config import WatchdogConfig
from robust_plugins.watchdog import detect, flight
from robust_plugins.watchdog.faults import Fault
from robust_plugins.launcher.monitor import Monitor
from robust_plugins.launcher.nodes import exchange_hang_views, node_blame

pytestmark = pytest.mark.timeout(60)

ITEM = [("train_step", "/job/train.py", 88), ("main", "/job/train.py", 140), ("<module>", "/job/train.py", 151)]
SYNC = [("synchronize", "/venv/torch/cuda/__init__.py", 1040), ("train_step", "/job/train.py", 91),
        ("main", "/job/train.py", 140), ("<module>", "/job/train.py", 151)]
COMPUTE = [("forward", "/job/model.py", 40), ("train_step", "/job/train.py", 80), ("main", "/job/train.py", 140),
           ("<module>", "/job/train.py", 151)]


class Rank:
    """One rank's flight recorder, written the way ProcessGroupNCCL records it."""

    def __init__(self, rank: int):
        self.rank = rank
        self.groups: dict[str, dict] = {}   # name -> {"id", "ranks", "seq", "p2p"}
        self.entries: list[dict] = []

    def group(self, name: str, ranks: list[int], desc: str = "") -> "Rank":
        self.groups[name] = {"id": len(self.groups), "ranks": ranks, "seq": 0, "p2p": 0, "desc": desc}
        return self

    def coll(self, name: str, op: str = "all_reduce", state: str = "completed", n: int = 1) -> "Rank":
        g = self.groups[name]
        for _ in range(n):
            g["seq"] += 1
            self._entry(g, name, f"nccl:{op}", state, False)
        return self

    def p2p(self, name: str, op: str, peer: int, state: str = "scheduled") -> "Rank":
        g = self.groups[name]
        g["p2p"] += 1
        me, other = g["ranks"].index(self.rank), g["ranks"].index(peer)
        label = f"nccl:send {me}->{other}" if op == "send" else f"nccl:recv {me}<-{other}"
        self._entry(g, name, label, state, True)
        return self

    def batch(self, name: str, ops: list[tuple[str, int]], state: str = "scheduled") -> "Rank":
        """A ``batch_isend_irecv`` on NCCL: one entry per op, sharing one ``p2p_seq_id``, that never
        completes (no events of its own), then the ``nccl:coalesced`` entry that carries the state."""
        g = self.groups[name]
        g["p2p"] += 1
        for op, peer in ops:
            me, other = g["ranks"].index(self.rank), g["ranks"].index(peer)
            label = f"nccl:send {me}->{other}" if op == "send" else f"nccl:recv {me}<-{other}"
            self._entry(g, name, label, "scheduled", True)
            self.entries[-1].update(time_discovered_completed_ns=None, retired=False)
        self._entry(g, name, "nccl:coalesced", state, True)
        return self

    def _entry(self, g, name, label, state, p2p):
        self.entries.append({
            "record_id": len(self.entries), "pg_id": g["id"], "process_group": [name, g["desc"]],
            "thread_name": "pt_main_thread", "thread_id": "140", "collective_seq_id": g["seq"],
            "p2p_seq_id": g["p2p"], "op_id": len(self.entries) + 1, "profiling_name": label,
            "time_created_ns": 1_000 + len(self.entries), "input_sizes": [[1024]], "input_dtypes": ["Float"],
            "output_sizes": [[1024]], "output_dtypes": ["Float"], "state": state,
            "time_discovered_started_ns": 0, "time_discovered_completed_ns": 0 if state != "completed" else 5,
            "retired": state == "completed", "timeout_ms": 600000, "is_p2p": p2p})

    def dump(self) -> dict:
        status = {}
        for name, g in self.groups.items():
            done = max([e["collective_seq_id"] for e in self.entries
                        if e["process_group"][0] == name and e["state"] == "completed" and not e["is_p2p"]] or [0])
            status[str(g["id"])] = {"last_enqueued_collective": str(g["seq"]), "last_started_collective": "-1",
                                    "last_completed_collective": str(done)}
        return {"version": "2.10", "comm_lib_version": "2.27.5",
                "pg_config": {n: {"name": n, "desc": g["desc"], "ranks": str(g["ranks"])} for n, g in self.groups.items()},
                "pg_status": status, "entries": list(self.entries)}


def _views(ranks: list[Rank], unreadable=()) -> dict:
    return flight.views({r.rank: (None if r.rank in unreadable else {"nccl": r.dump()}) for r in ranks})


def _dp_world(world: int, stuck: int) -> list[Rank]:
    # Every rank issued 5 all-reduces on the world group and all completed; all but `stuck` then
    # issued the 6th (scheduled on the device, waiting for the missing peer).
    out = []
    for r in range(world):
        rank = Rank(r).group("0", list(range(world)), "default_pg").coll("0", n=5)
        if r != stuck:
            rank.coll("0", state="scheduled")
        out.append(rank)
    return out


def test_group_view_names_groups_by_their_global_name_not_the_per_rank_pg_id():
    # Rank 0 is in TP group "1" (its pg_id 1) and DP group "3" (pg_id 2); rank 2 is in TP group "2"
    # (pg_id 1 as well) and DP group "3" (pg_id 2). Keyed by pg_id, rank 0's TP and rank 2's TP
    # would be one group.
    r0 = Rank(0).group("0", [0, 1, 2, 3]).group("1", [0, 1]).group("3", [0, 2]).coll("1", n=4).coll("3", n=2)
    r2 = Rank(2).group("0", [0, 1, 2, 3]).group("2", [2, 3]).group("3", [0, 2]).coll("2", n=9).coll("3", n=2)
    v0, v2 = detect.group_view({"nccl": r0.dump()}), detect.group_view({"nccl": r2.dump()})
    assert set(v0) == {"nccl:1", "nccl:3"} and set(v2) == {"nccl:2", "nccl:3"}
    assert v0["nccl:1"].members == [0, 1] and v0["nccl:1"].enqueued == 4
    assert detect.localize_by_sequence({0: v0, 2: v2}) is None  # TP counts differ, but on other groups


@pytest.mark.parametrize("world, per_node, stuck", [(8, 4, 6), (16, 8, 3), (64, 8, 41)])
def test_the_node_of_the_rank_that_did_not_enter_is_blamed_and_healthy_nodes_never(world, per_node, stuck):
    views = _views(_dp_world(world, stuck))
    where = detect.localize_by_sequence(flight.from_json(views))
    assert where.suspects == [stuck] and where.stuck == [stuck] and where.by == "flight_recorder"
    assert f"rank {stuck} issued collective 5 of group nccl:0" in where.reason
    verdict = detect.hang_verdict(where, block_host=False)
    assert verdict["blame"] and verdict["stuck"] == [stuck]
    for node in range(world // per_node):
        local = set(range(node * per_node, (node + 1) * per_node))
        fault = Fault(kind="hang", step=6, suspect_ranks=where.suspects, suspect_hosts=["x"],
                      detected_after_s=1.0, action="restart",
                      detail={"verdict": verdict, "in_collective": {str(r): False for r in local}})
        blamed = node_blame(fault, local)
        assert (blamed is not None) == (stuck in local), (node, blamed)


def test_one_nodes_view_alone_blames_none_of_its_waiting_ranks(tmp_path):
    # Node A (ranks 0-3) waits for rank 6 on node B. Its own flight recorders agree with each other
    # and its stacks sit in .item() / synchronize: outside any collective. The old rule ("stuck
    # outside a collective") blamed node A here.
    ranks = _dp_world(8, stuck=6)[:4]
    views = _views(ranks)
    assert detect.localize_by_sequence(flight.from_json(views)) is None
    where = detect.localize({0: ITEM, 1: SYNC, 2: ITEM, 3: ITEM}, {r: 5 for r in range(4)})
    assert not any(detect.in_collective(f) for f in (ITEM, SYNC))
    verdict = detect.hang_verdict(where, block_host=False)
    assert not verdict["blame"] and "NCCL" in verdict["why"]
    fault = Fault(kind="hang", step=6, suspect_ranks=where.suspects, suspect_hosts=["a"], detected_after_s=1.0,
                  action="restart", detail={"verdict": verdict, "in_collective": {str(r): False for r in range(4)}})
    assert node_blame(fault, {0, 1, 2, 3}) is None
    # The same stacks on gloo (its collectives block the host) keep the stack rule.
    assert detect.hang_verdict(where, block_host=True)["blame"]


def test_megatron_tp_peer_waiting_in_its_tp_all_reduce_is_a_victim_not_a_suspect():
    # TP groups [0,1] [2,3], DP groups [0,2] [1,3]; rank 1 is stuck in compute. Rank 0 issued TP
    # all-reduce 3 and waits; so it never issued DP all-reduce 2, where rank 2 waits for it.
    r = {i: Rank(i).group("0", [0, 1, 2, 3]) for i in range(4)}
    for i in range(4):
        r[i].group("1" if i < 2 else "2", [0, 1] if i < 2 else [2, 3])
        r[i].group("3" if i % 2 == 0 else "4", [0, 2] if i % 2 == 0 else [1, 3])
    for i in range(4):
        tp, dp = ("1" if i < 2 else "2"), ("3" if i % 2 == 0 else "4")
        r[i].coll(tp, n=2).coll(dp, n=1)
    r[0].coll("1", state="scheduled")           # waits for rank 1 in TP
    r[2].coll("2", n=1).coll("3", state="scheduled")  # its TP step done; waits for rank 0 in DP
    r[3].coll("2", n=1).coll("4", state="scheduled")  # waits for rank 1 in DP
    where = detect.localize_by_sequence(flight.from_json(_views(list(r.values()))))
    assert where.suspects == [1] and where.stuck == [1]
    assert "ranks [0] lag too but wait" in where.reason


def test_pipeline_stage_that_posted_no_recv_is_named_and_a_matched_transfer_names_none():
    # PP group [0, 4] (stage 0 on node A, stage 1 on node B): stage 0 sends activations to stage 1.
    def stages(stage1_posted: bool):
        s0 = Rank(0).group("0", [0, 4]).group("5", [0, 4], "pp").coll("0", n=3).p2p("5", "send", 4)
        s1 = Rank(4).group("0", [0, 4]).group("5", [0, 4], "pp").coll("0", n=3)
        if stage1_posted:
            s1.p2p("5", "recv", 0)
        return _views([s0, s1])

    where = detect.localize_by_sequence(flight.from_json(stages(False)))
    assert where.suspects == [4] and where.stuck == [4]
    assert "rank 4 posted no recv for rank 0's pending send on group nccl:5" in where.reason
    # Both posted: the transfer itself hangs (a link); nothing names a rank.
    assert detect.localize_by_sequence(flight.from_json(stages(True))) is None


def test_batched_p2p_is_read_by_its_coalesced_entry_so_a_stage_that_posted_no_batch_is_named():
    # batch_isend_irecv (megatron's batch_p2p_comm=True): NCCL records each op without completion
    # events; only the batch's "nccl:coalesced" entry completes. Read op by op, every past batch
    # looks pending on both stages forever and matches itself: no verdict on a stalled stage.
    def stages(stage1_posted: bool):
        s0 = Rank(0).group("0", [0, 4]).group("5", [0, 4], "pp").coll("0", n=3)
        s1 = Rank(4).group("0", [0, 4]).group("5", [0, 4], "pp").coll("0", n=3)
        for _ in range(3):  # three steps of 1F1B exchanges, all done
            s0.batch("5", [("send", 4), ("recv", 4)], state="completed")
            s1.batch("5", [("recv", 0), ("send", 0)], state="completed")
        s0.batch("5", [("send", 4)])  # step 4: stage 0 sends its activation ...
        if stage1_posted:
            s1.batch("5", [("recv", 0)])  # ... stage 1 is stuck in the transfer, or never posted it
        return _views([s0, s1])

    views = flight.from_json(stages(False))
    assert views[4]["nccl:5"].pending_p2p == [] and not views[4]["nccl:5"].waiting
    assert views[0]["nccl:5"].pending_p2p == [("send", 4)]
    where = detect.localize_by_sequence(views)
    assert where.suspects == [4] and where.stuck == [4]
    assert "rank 4 posted no recv for rank 0's pending send on group nccl:5" in where.reason
    assert detect.localize_by_sequence(flight.from_json(stages(True))) is None


def test_a_cycle_of_waiting_ranks_names_both_and_blames_neither():
    # Rank 0 waits in group "1" for rank 1, which waits in group "2" for rank 0 (issued in
    # different orders): a program bug, not a node's fault.
    a = Rank(0).group("1", [0, 1]).group("2", [0, 1]).coll("1", n=2).coll("2", n=2).coll("1", state="scheduled")
    b = Rank(1).group("1", [0, 1]).group("2", [0, 1]).coll("1", n=2).coll("2", n=2).coll("2", state="scheduled")
    where = detect.localize_by_sequence(flight.from_json(_views([a, b])))
    assert where.suspects == [0, 1] and where.stuck == []
    verdict = detect.hang_verdict(where, block_host=False)
    assert not verdict["blame"]
    for local in ({0}, {1}):
        fault = Fault(kind="hang", step=3, suspect_ranks=[0, 1], suspect_hosts=["x"], detected_after_s=1.0,
                      action="restart", detail={"verdict": verdict, "in_collective": {}})
        assert node_blame(fault, local) is None


def test_everyone_entered_and_unreadable_ranks_blame_nobody():
    views = _views([Rank(r).group("0", [0, 1, 2]).coll("0", n=4).coll("0", state="scheduled") for r in range(3)])
    assert detect.localize_by_sequence(flight.from_json(views)) is None
    verdict = detect.hang_verdict(None, block_host=False, why="every rank entered")
    assert verdict == {"by": "none", "blame": False, "stuck": [], "why": "every rank entered"}
    # Rank 2 unreadable, rank 1 behind: 1 is stuck, 2 only a suspect (never cleared, never blamed).
    ranks = _dp_world(3, stuck=1)
    where = detect.localize_by_sequence(flight.from_json(_views(ranks, unreadable={2})))
    assert where.suspects == [1, 2] and where.stuck == [1]
    fault = Fault(kind="hang", step=6, suspect_ranks=[1, 2], suspect_hosts=["x"], detected_after_s=1.0,
                  action="restart", detail={"verdict": detect.hang_verdict(where, False)})
    assert node_blame(fault, {2}) is None and node_blame(fault, {1}) is not None


def test_the_monitor_rejudges_on_every_nodes_views_and_says_when_nothing_names_a_rank(tmp_path):
    world = _dp_world(8, stuck=6)
    node_a = _views(world[:4])
    node_b = _views(world[4:])
    mon = Monitor(WatchdogConfig(), tmp_path / "a", host="nodeA")
    try:
        local = detect.localize({r: ITEM for r in range(4)}, {r: 5 for r in range(4)})
        fault = Fault(kind="hang", step=6, suspect_ranks=local.suspects, suspect_hosts=["nodeA"],
                      detected_after_s=1.0, action="restart",
                      detail={"reason": local.reason, "collectives_block_host": False, "flight_recorder": node_a,
                              "verdict": detect.hang_verdict(None, False),
                              "in_collective": {str(r): False for r in range(4)}})
        mon.rejudge_hang(fault, [{"node": "nodeA", "ranks": [0, 1, 2, 3], "views": node_a},
                                 {"node": "nodeB", "ranks": [4, 5, 6, 7], "views": node_b}])
        assert fault.suspect_ranks == [6] and fault.suspect_hosts == ["nodeB"]
        assert fault.detail["verdict"]["stuck"] == [6] and fault.detail["flight_recorder_nodes"] == ["nodeA", "nodeB"]
        assert node_blame(fault, {0, 1, 2, 3}) is None and node_blame(fault, {4, 5, 6, 7}) is not None
        # Every rank of the job entered the collective: said, and nobody blamed.
        entered = _views([Rank(r).group("0", list(range(8))).coll("0", n=6, state="scheduled") for r in range(8)])
        fault.detail["verdict"] = {"by": "stacks", "blame": True, "stuck": []}
        mon.rejudge_hang(fault, [{"node": "nodeA", "views": {k: v for k, v in entered.items() if k < 4}},
                                 {"node": "nodeB", "views": {k: v for k, v in entered.items() if k >= 4}}])
        assert not fault.detail["verdict"]["blame"] and "every rank entered" in fault.detail["verdict"]["why"]
    finally:
        mon.close()


def test_nodes_exchange_their_views_through_the_rendezvous_store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=10))
    out = {}

    def node(name, store, ranks):
        out[name] = exchange_hang_views(store, "3", name, {"ranks": ranks, "views": {str(ranks[0]): None}}, 2, 10.0)

    threads = [threading.Thread(target=node, args=("A", server, [0, 1])),
               threading.Thread(target=node, args=("B", client, [2, 3]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert [e["node"] for e in out["A"]] == ["A", "B"] and [e["node"] for e in out["B"]] == ["B", "A"]
    # A lost node: the wait ends at its bound with this node's own view.
    alone = exchange_hang_views(server, "4", "A", {"ranks": [0], "views": {}}, 2, 0.3)
    assert [e["node"] for e in alone] == ["A"]
