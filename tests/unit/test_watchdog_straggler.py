"""Straggler detection without processes: the pure detector, the settings, ``slow`` injection,
the client's compute/collective split and the monitor's report (never a restart)."""

from __future__ import annotations

import json
import socket
import time

import pytest

from robust_plugins.config import PluginConfig, WatchdogConfig
from robust_plugins.errors import ConfigError
from robust_plugins.watchdog import client, inject, protocol, straggler
from robust_plugins.watchdog.faults import read_faults
from _wait import wait_for as _wait_for


def test_detector_names_the_rank_whose_median_compute_exceeds_factor_times_its_peers():
    compute = {0: [0.10] * 20, 1: [0.10] * 19 + [0.9], 2: [0.35] * 20, 3: [0.11] * 20}
    (s,) = straggler.stragglers(compute, factor=2.0, window=20)
    assert s.rank == 2 and s.compute_s == pytest.approx(0.35)
    assert s.peers_s == pytest.approx(0.10) and s.ratio == pytest.approx(3.5)


def test_detector_waits_for_a_full_window_and_ignores_isolated_slow_steps():
    assert straggler.stragglers({0: [0.1] * 5, 1: [1.0] * 4}, 2.0, 5) == []  # rank 1 lacks a window
    noisy = {0: [0.1, 0.1, 0.9, 0.1, 0.1], 1: [0.1] * 5}  # one garbage-collection pause
    assert straggler.stragglers(noisy, 2.0, 5) == []
    assert straggler.stragglers({0: [0.1] * 5, 1: [1.0] * 5}, 0, 5) == []  # factor 0: off
    assert straggler.stragglers({0: [1.0] * 5}, 2.0, 5) == []  # one rank has no peers


def test_detector_at_scale_names_exactly_the_slow_ranks():
    compute = {r: [0.05 + 0.001 * (r % 7)] * 30 for r in range(1024)}
    for r in (17, 900):
        compute[r] = [0.2] * 30
    assert [s.rank for s in straggler.stragglers(compute, 2.0, 30)] == [17, 900]


def test_pipeline_stages_are_compared_within_themselves():
    """Stage 1 computes 2.5 x stage 0 (the output layer and the loss): no rank of it straggles
    against its own stage; without groups, every stage-1 rank would be named."""
    compute = {0: [0.10] * 10, 1: [0.11] * 10, 2: [0.25] * 10, 3: [0.26] * 10}
    stage = {0: "pp0", 1: "pp0", 2: "pp1", 3: "pp1"}
    assert [s.rank for s in straggler.stragglers(compute, 2.0, 10)] == [2, 3]  # the unfair verdict
    assert straggler.stragglers(compute, 2.0, 10, stage) == []
    compute[2] = [0.6] * 10  # a slow rank of the heavy stage: against its stage peer only
    (s,) = straggler.stragglers(compute, 2.0, 10, stage)
    assert (s.rank, s.peers_s) == (2, pytest.approx(0.26)) and s.ratio == pytest.approx(0.6 / 0.26)
    compute[0] = [0.19] * 10  # 1.9 x its stage peer: not over the bar, though over stage 1's median
    assert [s.rank for s in straggler.stragglers(compute, 2.0, 10, stage)] == [2]


def test_a_rank_alone_in_its_group_is_not_judged_and_ungrouped_ranks_compare_among_themselves():
    compute = {0: [1.0] * 5, 1: [0.1] * 5, 2: [0.1] * 5, 3: [0.4] * 5}
    (s,) = straggler.stragglers(compute, 2.0, 5, {0: "pp0"})  # rank 0, 10 x the others, has no peer
    assert s.rank == 3 and s.peers_s == pytest.approx(0.1)  # ranks 1-3 have no group: one group
    medians = {r: v[0] for r, v in compute.items()}
    assert straggler.peer_median(medians, 0, {0: "pp0"}) is None
    assert straggler.peer_median(medians, 1, None) == pytest.approx(0.4)  # median of 1.0, 0.1, 0.4


def test_stage_grouping_at_scale_names_exactly_the_slow_ranks():
    """64 stages x 16 ranks, each stage's cost its own (the last one 3 x the first): the slow
    ranks of light and heavy stages alike are named, nobody else."""
    compute, groups = {}, {}
    for r in range(1024):
        stage = r // 16
        compute[r] = [(0.05 + 0.1 * (stage == 63)) * (1 + 0.01 * (r % 5))] * 30
        groups[r] = f"pp{stage}"
    for r in (3, 1010):
        compute[r] = [x * 2.5 for x in compute[r]]
    assert [s.rank for s in straggler.stragglers(compute, 2.0, 30, groups)] == [3, 1010]


@pytest.mark.parametrize("block, bad", [
    ({"straggler_factor": 1.0}, "straggler_factor = 1.0 must be 0 (off) or a finite number > 1"),
    ({"straggler_factor": "2"}, "straggler_factor must be a number"),
    ({"straggler_window": 2}, "straggler_window = 2 must be >= 3"),
    ({"straggler_windw": 5}, "straggler_window"),  # did you mean
])
def test_bad_straggler_settings_are_refused(block, bad):
    with pytest.raises(ConfigError) as err:
        PluginConfig.from_dict({"watchdog": block})
    assert bad in str(err.value)


def test_slow_injection_parses_with_default_and_refuses_bad_seconds():
    (a, b) = inject.parse("slow:rank=1,step=3,seconds=0.25;slow:rank=0,step=2")
    assert (a.kind, a.option, b.option) == ("slow", "0.25", str(inject.SLOW_DEFAULT_S))
    assert inject.parse(a.spec()) == [a]
    for spec, bad in (("slow:rank=1,step=3,seconds=0", "seconds='0' must be a number in (0, 60]"),
                      ("slow:rank=1,step=3,seconds=x", "seconds='x'"),
                      ("slow:rank=1,step=3,delay=1", "unknown key 'delay' for slow")):
        with pytest.raises(ConfigError, match="Allowed forms") as err:
            inject.parse(spec)
        assert bad in str(err.value)


def _client_with_server(tmp_path, monkeypatch, inject_spec=""):
    path = str(tmp_path / "m.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    srv.bind(path)
    srv.settimeout(5)
    monkeypatch.setenv(protocol.ENV_SOCKET, path)
    monkeypatch.setenv(protocol.ENV_INJECT, inject_spec)
    monkeypatch.setenv(protocol.ENV_STRAGGLER, "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv(protocol.ENV_RUN_DIR, raising=False)
    monkeypatch.setattr(client, "_client", None)
    monkeypatch.setattr(client, "_checked", False)
    monkeypatch.setattr(client, "_die_with_parent", lambda: None)
    return srv


def test_client_splits_each_step_into_compute_and_collective_time_and_slows_from_step_s(
        tmp_path, monkeypatch):
    import torch.distributed as dist

    srv = _client_with_server(tmp_path, monkeypatch, "slow:rank=0,step=3,seconds=0.2")
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        for step in range(1, 6):
            client.step_end(step, loss=1.0)
            if step == 1:
                client.step_end(1, loss=1.0)  # a second report of the same step: ignored
        msgs = [json.loads(srv.recv(65536)) for _ in range(8)]
    finally:
        dist.destroy_process_group()
        srv.close()
        c = client.get_client()
        if c is not None and c.comm is not None:
            c.comm.__exit__(None, None, None)
    kinds = [m["k"] for m in msgs]
    # The first step also says what the default group's collectives move (the hang verdict's input).
    assert kinds == ["hello", "comm", "end", "end", "inject", "end", "end", "end"]
    assert msgs[1]["dev"] == "cpu"
    ends = {m["s"]: m for m in msgs if m["k"] == "end"}
    assert "w" not in ends[1] and set(ends) == {1, 2, 3, 4, 5}
    assert all("c" in ends[s] for s in (2, 3, 4, 5))
    # From step 3 on the rank sleeps 0.2 s a step outside any collective.
    for s in (4, 5):
        assert ends[s]["w"] >= 0.2 and ends[s]["w"] - ends[s]["c"] >= 0.2


def test_client_counts_time_inside_collectives(tmp_path, monkeypatch):
    import torch
    import torch.distributed as dist

    srv = _client_with_server(tmp_path, monkeypatch)
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        client.step_end(1)
        c = client.get_client()
        assert c.comm is not None
        t = torch.zeros(4)
        t0 = time.perf_counter()
        for _ in range(3):
            dist.all_reduce(t)
        inside = c.comm.seconds
        time.sleep(0.1)  # compute
        client.step_end(2)
        msgs = []
        while len(msgs) < 3:  # hello, the two steps (the first step also says its backend: "comm")
            msg = json.loads(srv.recv(65536))
            if msg["k"] != "comm":
                msgs.append(msg)
    finally:
        dist.destroy_process_group()
        srv.close()
        c = client.get_client()
        if c is not None and c.comm is not None:
            c.comm.__exit__(None, None, None)
    end = msgs[2]
    assert end["k"] == "end" and end["s"] == 2
    assert end["c"] == pytest.approx(inside, abs=1e-9) and 0 < end["c"] < time.perf_counter() - t0
    assert end["w"] - end["c"] >= 0.1


def test_monitor_reports_a_straggler_once_without_stopping_the_ranks(tmp_path):
    from robust_plugins.launcher.monitor import Monitor

    cfg = WatchdogConfig(straggler_factor=2.0, straggler_window=5, straggler_min_s=0)  # 7 s episode
    mon = Monitor(cfg, tmp_path, host="node7")
    assert mon.worker_env()[protocol.ENV_STRAGGLER] == "1"
    try:
        mon.begin_incarnation({0: 100, 1: 101, 2: 102})
        tx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        now = time.time()
        for step in range(1, 12):
            for r in (0, 1, 2):
                # Equal step times (lockstep); rank 2 computes 0.3 s from step 4, the others wait.
                compute = 0.3 if (r == 2 and step >= 4) else 0.05
                w = 0.35 if step >= 4 else 0.1
                tx.sendto(json.dumps({"k": "end", "r": r, "i": 0, "s": step, "t": now + step, "l": 1.0,
                                      "w": w, "c": w - compute}).encode(), mon.address)
        assert _wait_for(lambda: all(mon.ranks[r].progress.last_step == 11 for r in (0, 1, 2)))
        assert mon.check(will_restart=True) is None  # reported, not a reason to restart
        assert mon.check(will_restart=True) is None  # and reported once
        tx.close()
    finally:
        mon.close()
    (line,) = read_faults(tmp_path / "faults.jsonl")
    assert (line["kind"], line["suspect_ranks"], line["suspect_hosts"], line["action"]) == (
        "straggler", [2], ["node7"], "report")
    assert line["step"] == 4  # the first step of the slow run
    assert line["detail"]["ratio"] == pytest.approx(6.0)
    assert "rank 2 computes 300 ms" in line["detail"]["reason"]
    assert mon.all_faults == [] and len(mon.reports) == 1


def test_client_names_its_straggler_group_once_and_refuses_an_empty_name(tmp_path, monkeypatch):
    srv = _client_with_server(tmp_path, monkeypatch)
    try:
        client.straggler_group("pp1")
        msgs = [json.loads(srv.recv(65536)) for _ in range(2)]
    finally:
        srv.close()
    assert [(m["k"], m.get("g")) for m in msgs] == [("hello", None), ("group", "pp1")]
    with pytest.raises(ConfigError, match="straggler_group.*non-empty string"):
        client.straggler_group("")


def test_monitor_compares_each_pipeline_stage_with_itself(tmp_path):
    """Ranks 2 and 3 (stage pp1) compute 2.5 x ranks 0 and 1 (pp0) every step: no report. Rank 1
    computes 3 x its stage peer from step 4: reported, against rank 0 alone."""
    from robust_plugins.launcher.monitor import Monitor

    cfg = WatchdogConfig(straggler_factor=2.0, straggler_window=5, straggler_min_s=0)  # 7 s episode
    mon = Monitor(cfg, tmp_path, host="node7")
    try:
        mon.begin_incarnation({0: 100, 1: 101, 2: 102, 3: 103})
        tx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        now = time.time()
        for r in range(4):
            tx.sendto(json.dumps({"k": "group", "r": r, "i": 0, "t": now, "g": f"pp{r // 2}"}).encode(),
                      mon.address)
        for step in range(1, 12):
            for r in range(4):
                compute = {0: 0.05, 1: 0.15 if step >= 4 else 0.05, 2: 0.125, 3: 0.125}[r]
                tx.sendto(json.dumps({"k": "end", "r": r, "i": 0, "s": step, "t": now + step, "l": 1.0,
                                      "w": 0.4, "c": 0.4 - compute}).encode(), mon.address)
        assert _wait_for(lambda: all(mon.ranks[r].progress.last_step == 11 for r in range(4)))
        assert mon.ranks[3].straggler_group == "pp1"
        assert mon.check(will_restart=True) is None
        tx.close()
    finally:
        mon.close()
    (line,) = read_faults(tmp_path / "faults.jsonl")
    assert (line["kind"], line["suspect_ranks"], line["step"]) == ("straggler", [1], 4)
    assert line["detail"]["group"] == "pp0" and line["detail"]["ratio"] == pytest.approx(3.0)
    assert "group 'pp0'" in line["detail"]["reason"]


@pytest.mark.timeout(60)
def test_an_episode_ends_only_after_a_window_of_fast_steps_and_sums_up_its_slow_ones():
    ep = straggler.StragglerEpisode(rank=2, first_step=4, onset_wall=100.0, detected_wall=103.0,
                                 last_slow_step=4, last_slow_wall=100.0, seen_step=3)
    walls = iter(range(100, 200))
    for step in range(4, 30):
        # Slow 4-11, fast 12-13 (a moved load), slow again 14-17, then fast for good.
        slow = 4 <= step <= 11 or 14 <= step <= 17
        ep.observe(step, 0.3 if slow else 0.05, 0.05, 2.0, float(next(walls)))
        if step == 13:
            assert not ep.over(5)  # two fast steps: still the same episode
    ep.observe(29, 0.3, 0.05, 2.0, 500.0)  # already judged: ignored
    assert ep.over(5)
    # 12 fast steps spanning 12 s of the rank's clock: not over while the gap asks for 13 s.
    assert ep.over(5, gap_s=12.0) and not ep.over(5, gap_s=13.0)
    assert ep.lasted(13.0) and not ep.lasted(13.5)  # slow from wall 100 to 113
    sm = ep.summary()
    assert sm["slow_steps"] == 12 and sm["last_slow_step"] == 17 and sm["ratio"] == pytest.approx(6.0)
    assert sm["duration_s"] == pytest.approx(113.0 - 100.0) and sm["compute_s"] == pytest.approx(0.3)


@pytest.mark.timeout(60)
def test_monitor_reports_a_flapping_straggler_once_per_episode_when_it_ends(tmp_path):
    # The load moves: rank 1 is slow for 12 steps, fast for 2, slow for 6, then fast for 12 (the
    # episode ends), then slow again to the job's end (a second episode). Two rows, not one a move.
    from robust_plugins.launcher.monitor import Monitor

    # Steps of 1 s: a 5 s gap lets the 12 fast seconds end the first episode.
    cfg = WatchdogConfig(straggler_factor=2.0, straggler_window=5, straggler_min_s=0, straggler_gap_s=5)
    mon = Monitor(cfg, tmp_path, host="n")
    tx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    slow_steps = set(range(3, 15)) | set(range(17, 23)) | set(range(35, 45))
    try:
        mon.begin_incarnation({0: 100, 1: 101, 2: 102})
        now = time.time()
        for step in range(1, 45):
            for r in (0, 1, 2):
                compute = 0.3 if (r == 1 and step in slow_steps) else 0.05
                tx.sendto(json.dumps({"k": "end", "r": r, "i": 0, "s": step, "t": now + step, "l": 1.0,
                                      "w": 0.4, "c": 0.4 - compute}).encode(), mon.address)
            assert _wait_for(lambda: all(mon.ranks[r].progress.last_step == step for r in (0, 1, 2)))
            assert mon.check(will_restart=True) is None
        first = read_faults(tmp_path / "faults.jsonl")
        mon.flush_faults()  # the job ends with rank 1 slow: its open episode is written now
    finally:
        tx.close()
        mon.close()
    (ended,) = first
    assert (ended["kind"], ended["suspect_ranks"], ended["step"]) == ("straggler", [1], 3)
    assert ended["detail"]["ended"] == "recovered" and ended["detail"]["slow_steps"] == 18
    assert ended["detail"]["last_slow_step"] == 22 and ended["detail"]["duration_s"] == pytest.approx(19.0)
    rows = read_faults(tmp_path / "faults.jsonl")
    assert len(rows) == 2 and rows[1]["step"] == 35 and rows[1]["detail"]["ended"] == "job end"
    assert len(mon.reports) == 2 and mon.all_faults == []


def _straggler_rows(cfg: WatchdogConfig, compute_of, steps: int, step_s: float, tmp_path) -> list:
    """The straggler rows the monitor's detectors write for 4 ranks whose compute time at each
    step is ``compute_of(rank, step)``, steps ``step_s`` apart on the ranks' clock, judged after
    every step as the monitor's check does, the job ending after ``steps``."""
    import threading

    from robust_plugins.launcher.monitor.detectors import Detectors
    from robust_plugins.launcher.monitor.faultlog import FaultBook, Injections
    from robust_plugins.launcher.monitor.state import _RankState

    lock = threading.Lock()
    book = FaultBook(tmp_path, lock, Injections())
    det = Detectors(cfg, tmp_path, "n", lock, book, record=None, drain=lambda: None)
    ranks = {r: _RankState(registered=True) for r in range(4)}
    for step in range(1, steps + 1):
        for r, st in ranks.items():
            st.compute.append((step, compute_of(r, step), 1000.0 + step * step_s))
        det._check_stragglers(ranks, 0, 1000.0 + step * step_s)
    det.end_straggler_episodes(ranks, 0, "job end")
    return det.reports


@pytest.mark.timeout(60)
def test_hysteresis_a_steady_slow_rank_is_one_episode_however_it_wobbles(tmp_path):
    # Rank 2 computes 3 x its peers for 200 steps of 0.5 s, except 6 fast steps (3 s) every
    # 40 (the other job on its cores pauses): without the gap each pause ends the episode.
    def compute(r, step):
        return 0.3 if r == 2 and step >= 10 and step % 40 >= 6 else 0.1

    plain = WatchdogConfig(straggler_window=5, straggler_min_s=0, straggler_gap_s=0)
    assert len(_straggler_rows(plain, compute, 200, 0.5, tmp_path / "a")) == 5  # one row a pause
    (row,) = _straggler_rows(WatchdogConfig(straggler_window=5), compute, 200, 0.5, tmp_path / "b")
    assert (row.suspect_ranks, row.step, row.detail["ended"]) == ([2], 10, "job end")
    assert row.detail["duration_s"] == pytest.approx((199 - 10) * 0.5)
    assert row.detail["ratio"] == pytest.approx(3.0) and row.detail["gap_s"] == 60.0
    assert read_faults(tmp_path / "b" / "faults.jsonl")[0]["suspect_ranks"] == [2]


@pytest.mark.timeout(60)
def test_hysteresis_a_noisy_fair_machine_reports_no_straggler(tmp_path):
    # Every rank the same work; 0.5 s steps with +-20 % jitter, and now and then one rank starved
    # 3 x for 4-12 steps (2-6 s: another job's burst on a shared machine).
    import random

    rng = random.Random(37)
    bursts = {}
    for start in range(20, 1200, 45):
        rank, length = rng.randrange(4), rng.randrange(4, 13)
        bursts.update({(rank, s): 3.0 for s in range(start, start + length)})
    jitter = {(r, s): rng.uniform(0.8, 1.2) for r in range(4) for s in range(1, 1201)}

    def compute(r, step):
        return 0.1 * jitter[r, step] * bursts.get((r, step), 1.0)

    plain = WatchdogConfig(straggler_window=5, straggler_min_s=0, straggler_gap_s=0)
    flapping = _straggler_rows(plain, compute, 1200, 0.5, tmp_path / "a")
    assert len(flapping) >= 20  # the flapping the knobs stop: rows every ~30 s of a 10-minute run
    assert _straggler_rows(WatchdogConfig(straggler_window=5), compute, 1200, 0.5, tmp_path / "b") == []
