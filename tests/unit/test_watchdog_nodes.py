"""Node blame, blame counts and the exclusion list in a (real) c10d store; grad_accumulation."""

from __future__ import annotations

import datetime
import json

import pytest
import torch.distributed as dist

from robust_plugins.config import PluginConfig
from robust_plugins.errors import ConfigError
from robust_plugins.watchdog import grad_accumulation
from robust_plugins.watchdog.faults import Fault
from robust_plugins.launcher.nodes import (EXCLUDED_FILE, Death, NodeExcluded, NodeRegistry, death_causes,
                                           first_causes, node_blame)


def _crash(ranks, signal=None, onset="last signal", kind="crash"):
    return Fault(kind=kind, step=5, suspect_ranks=ranks, suspect_hosts=["h"], detected_after_s=0.1,
                 action="restart", detail={"signal": signal, "onset": onset})


def test_only_local_evidence_blames_a_node():
    assert node_blame(_crash([1], "SIGKILL", "injected"), {1}).startswith("injected crash")
    assert "SIGSEGV" in node_blame(_crash([1], "SIGSEGV"), {0, 1})
    # Exit code 1 is what a rank that lost its peer on another node ends with: no evidence.
    assert node_blame(_crash([1], None), {1}) is None
    # The agent's own SIGTERM stops healthy peers.
    assert node_blame(_crash([1], "SIGTERM"), {1}) is None
    # Suspects on another node.
    assert node_blame(_crash([3], "SIGKILL"), {0, 1}) is None
    assert node_blame(_crash([1], kind="sdc"), {1}).startswith("silent data corruption")
    for kind in ("hang", "nan", "spike", "straggler"):
        assert node_blame(_crash([1], "SIGKILL", "injected", kind=kind), {1}) is None


@pytest.fixture
def store():
    # A real TCPStore server and two clients, as two agents of a job see it.
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    yield server
    del server


def test_two_blames_exclude_the_node_everywhere(store, tmp_path):
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=10))
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    b = NodeRegistry(client, "nodeB", tmp_path / "b", exclude_after=2)
    a = NodeRegistry(store, "nodeA", tmp_path / "a", exclude_after=2)
    assert b.blame(_crash([1], "SIGKILL"), "first") is None
    assert b.excluded() is None and a.refresh() == []
    rec = b.blame(_crash([1], "SIGKILL"), "second")
    assert rec["node"] == "nodeB" and rec["blames"] == 2 and rec["reason"] == "second"
    assert b.excluded()["node"] == "nodeB"
    assert [r["node"] for r in a.refresh()] == ["nodeB"]   # A learns it once
    assert a.refresh() == [] and a.excluded() is None
    for d in ("a", "b"):
        nodes = json.loads((tmp_path / d / EXCLUDED_FILE).read_text())["nodes"]
        assert [n["node"] for n in nodes] == ["nodeB"]
    # A relaunch of B with the same run directory (a fresh store) is still refused.
    fresh = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    assert NodeRegistry(fresh, "nodeB", tmp_path / "b", 2).excluded()["blames"] == 2
    err = NodeExcluded(rec)
    assert "nodeB" in str(err) and "exit code 3" in str(err)


def test_exclusion_off(store, tmp_path):
    reg = NodeRegistry(store, "n", tmp_path, exclude_after=0)
    for _ in range(3):
        assert reg.blame(_crash([0], "SIGKILL"), "x") is None
    assert reg.excluded() is None


def test_exclude_after_blames_is_validated():
    assert PluginConfig.from_dict({"watchdog": {"exclude_after_blames": 3}}).watchdog.exclude_after_blames == 3
    for bad in (-1, 1.5, "2", True):
        with pytest.raises(ConfigError, match="exclude_after_blames"):
            PluginConfig.from_dict({"watchdog": {"exclude_after_blames": bad}})


def test_grad_accumulation_keeps_the_global_batch(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("ROBUST_LAUNCH_WORLD_SIZE", raising=False)
    assert grad_accumulation(32, 4, 2) == 4
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("ROBUST_LAUNCH_WORLD_SIZE", "4")
    assert grad_accumulation(32, 4, 2) == 4
    assert "gradient accumulation 4 (was 2) keeps the global batch of 32" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert grad_accumulation(32, 4) == 1
    with pytest.raises(ConfigError, match="not a multiple of micro batch 4 x world size 3"):
        grad_accumulation(32, 4, 3)
    with pytest.raises(ConfigError, match="micro_batch = 0"):
        grad_accumulation(32, 0, 1)


def test_unreachable_store_falls_back_to_the_run_dir_file(tmp_path):
    class Gone:  # what a client of a store whose host died raises on every call
        def add(self, *a):
            raise RuntimeError("Connection reset by peer")

        check = get = set = add

    (tmp_path / EXCLUDED_FILE).write_text(json.dumps({"nodes": [
        {"node": "nodeB", "blames": 2, "reason": "r", "fault": {}}]}))
    assert NodeRegistry(Gone(), "nodeB", tmp_path, 2).excluded()["blames"] == 2
    assert NodeRegistry(Gone(), "nodeA", tmp_path, 2).excluded() is None


def test_a_hang_blames_the_node_only_when_its_suspects_are_outside_a_collective():
    def hang(where):
        return Fault(kind="hang", step=7, suspect_ranks=[1], suspect_hosts=["h"], detected_after_s=3.0,
                     action="restart", detail={"in_collective": where})

    assert "hung outside any collective" in node_blame(hang({"1": False}), {1})
    assert node_blame(hang({"1": True}), {1}) is None   # waiting for a peer elsewhere
    assert node_blame(hang({}), {1}) is None            # no readable stack: no evidence
    assert node_blame(hang({"1": False}), {0}) is None  # suspect on another node


# -- SIGABRT after a peer's death (NCCL's async error handling aborts the survivors) -----------------

NCCL_PEER_LOSS = ("[PG ID 0 PG GUID 0(default_pg) Rank 1] Process group watchdog thread terminated with "
                  "exception: NCCL error: remote process exited or there was a network error, NCCL version 2.21.5")
NCCL_TIMEOUT = ("[Rank 2] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=41, OpType=ALLREDUCE, "
                "NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600043 milliseconds before timing out.")
ABORT, KILL, SEGV, TERM = -6, -9, -11, -15


def _blame_of(deaths, local):
    """What node_blame says of the crash monitor.on_crash would build from ``deaths``."""
    ranks, causes = first_causes(deaths)
    first = next(d for d in deaths if d.rank == ranks[0])
    sig = {ABORT: "SIGABRT", KILL: "SIGKILL", SEGV: "SIGSEGV", TERM: "SIGTERM"}.get(first.exitcode)
    fault = Fault(kind="crash", step=5, suspect_ranks=[r for r in ranks if causes[r] == causes[ranks[0]]],
                  suspect_hosts=["h"], detected_after_s=0.1, action="restart",
                  detail={"signal": sig, "onset": "injected" if first.injected else "last signal",
                          "cause": causes[ranks[0]]})
    return ranks, causes, node_blame(fault, local)


def test_a_sigabrt_after_a_peers_death_is_no_evidence():
    # One node: rank 3 killed (OOM) at t=100, its NCCL peers aborted a second later. Rank 3 is
    # the suspect and its node is blamed for the SIGKILL, not for the aborts.
    deaths = [Death(0, ABORT, 101.0), Death(1, ABORT, 101.0), Death(3, KILL, 100.0), Death(2, TERM, 102.0)]
    ranks, causes, why = _blame_of(deaths, {0, 1, 2, 3})
    assert ranks[0] == 3 and causes == {3: "failed", 0: "peer_loss", 1: "peer_loss", 2: "stopped"}
    assert "SIGKILL" in why
    # Seen in the same poll (equal times): still the kill first, the aborts its consequence.
    same = [Death(0, ABORT, 100.0), Death(3, KILL, 100.0)]
    assert death_causes(same) == {0: "peer_loss", 3: "failed"}
    # The survivor node of a two-node job sees only its aborted ranks: their logs name NCCL's
    # peer loss (or its timeout): no blame.
    survivors = [Death(4, ABORT, 101.0, log="...\n" + NCCL_PEER_LOSS), Death(5, ABORT, 101.0, log=NCCL_TIMEOUT)]
    ranks, causes, why = _blame_of(survivors, {4, 5})
    assert set(causes.values()) == {"peer_loss"} and why is None
    # No log to read (no --redirects/--tee): nothing says the abort was the rank's own.
    assert _blame_of([Death(4, ABORT, 101.0), Death(5, ABORT, 101.5)], {4, 5})[2] is None


def test_a_first_sigabrt_with_a_clean_log_is_evidence():
    # The first death, its log read and free of NCCL's failure (a C++ assertion of its own).
    deaths = [Death(1, ABORT, 50.0, log="terminate called after throwing an instance of 'c10::Error'\n"),
              Death(0, ABORT, 52.0, log=NCCL_PEER_LOSS)]
    ranks, causes, why = _blame_of(deaths, {0, 1})
    assert ranks == [1, 0] and causes == {1: "aborted", 0: "peer_loss"}
    assert "rank(s) [1] died by SIGABRT" in why
    # A later SIGABRT with a clean log after an injected death is still the injection's consequence.
    assert death_causes([Death(2, KILL, 10.0, injected=True), Death(1, ABORT, 11.0, log="")]) == {
        2: "injected", 1: "peer_loss"}
    # An earlier SIGABRT with a clean log, then a SIGSEGV: the abort came first and is its own.
    assert first_causes([Death(1, ABORT, 9.0, log=""), Death(2, SEGV, 10.0)])[1] == {1: "aborted", 2: "failed"}


def test_a_recorded_sigabrt_without_a_cause_is_no_evidence():
    # A faults.jsonl line judged on the signal alone (no "cause"): SIGABRT does not count.
    assert node_blame(_crash([1], "SIGABRT"), {1}) is None
    assert node_blame(_crash([1], "SIGKILL"), {1}) is not None


def test_the_monitor_records_the_cause_from_the_order_and_the_ranks_logs(tmp_path):
    # Monitor.on_crash on torch's ProcessFailure fields: exit codes, times, and the stderr.log
    # torch writes beside each rank's error.json under --redirects/--tee.
    from types import SimpleNamespace

    from robust_plugins.config import WatchdogConfig
    from robust_plugins.launcher.monitor.monitor import Monitor

    def failure(rank, code, t, log=None):
        rank_dir = tmp_path / "logs" / str(rank)
        rank_dir.mkdir(parents=True, exist_ok=True)
        if log is not None:
            (rank_dir / "stderr.log").write_text("x" * 100_000 + log)  # the tail is what is read
        return SimpleNamespace(exitcode=code, timestamp=t, error_file=str(rank_dir / "error.json"))

    mon = Monitor(WatchdogConfig(), tmp_path / "run", host="h")
    try:
        one = mon.on_crash({0: failure(0, ABORT, 11, NCCL_PEER_LOSS), 1: failure(1, KILL, 10),
                            2: failure(2, TERM, 12)}, will_restart=True)
        survivors = mon.on_crash({4: failure(4, ABORT, 11, NCCL_TIMEOUT), 5: failure(5, ABORT, 11, "")},
                                 will_restart=True)
    finally:
        mon.close()
    assert one.suspect_ranks == [1] and one.detail["cause"] == "failed"
    assert one.detail["causes"] == {"1": "failed", "0": "peer_loss", "2": "stopped"}
    assert node_blame(one, {0, 1, 2}) is not None
    # Rank 4's log names NCCL's timeout: aborted by NCCL. Rank 5's log was read and names none,
    # and no death came before it: its abort is its own, the evidence.
    assert survivors.detail["causes"] == {"5": "aborted", "4": "peer_loss"}
    assert survivors.suspect_ranks == [5] and node_blame(survivors, {4, 5}) is not None
