"""Warm standby workers of ``robust run`` (on by default): every incarnation, the first included,
hands each rank to a process forked from the node's fork server, which imported torch and the
plugin once, and the script runs there exactly as in a fresh process (``--no-standby``); dead or
hung standbys and fork servers are replaced; none outlives a SIGKILLed launcher; where forking is
unsafe, standbys are spawned instead, loudly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import _alive, robust_run

from robust_plugins.launch import launch_env

pytestmark = [pytest.mark.fault]

HERE = Path(__file__).parent
PROBE = str(HERE / "standby_probe.py")

#: What differs between two incarnations' environments whether they start cold or warm: the
#: restart count, the incarnation's store port and error file, our incarnation and ring names.
PER_INCARNATION = {"TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_ERROR_FILE", "MASTER_PORT",
                   "ROBUST_INCARNATION", "ROBUST_WATCHDOG_RING", "ROBUST_INJECT"}
#: ... and between two jobs (a cold one and a warm one): the job's id.
PER_JOB = {"TORCHELASTIC_RUN_ID", "ROBUST_JOB_ID", "PYTEST_CURRENT_TEST"}

#: Fields of the probe's record that must be the same in a cold and a warm incarnation.
#: Not ``ppid``: a forked rank's parent is the fork server (``_forked_by``), a cold one's the agent.
SAME = ("argv", "cwd", "name", "file", "package", "spec", "loader", "path0", "main_is_me", "pickle",
        "threads_at_start")

#: The probe job of the cold/warm comparison: two incarnations, rank 1 killed at step 6.
PROBE_ARGS = ["--steps", "12", "--step-sleep", "0.05"]
KILL = ("--inject", "kill:rank=1,step=6")


def _probes(probe_dir: Path) -> dict[tuple[int, int], dict]:
    return {(int(p.stem.split("inc")[1].split("-")[0]), int(p.stem.split("rank")[1])): json.loads(p.read_text())
            for p in probe_dir.glob("probe-inc*-rank*.json")}


def _events(run_dir: Path) -> list[dict]:
    path = run_dir / "standbys.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _same_start(ref: dict, warm: dict, jobs: tuple[Path, Path] | None = None, cold: bool = True) -> None:
    """``warm`` (a standby's rank) started as ``ref`` did: a fresh process (``cold``) or another
    standby's rank. ``jobs``: the two jobs' directories, when ``ref`` is from another job."""
    def norm(x):
        if jobs is None:
            return x
        if isinstance(x, str):
            return x.replace(str(jobs[0]), "<job>").replace(str(jobs[1]), "<job>")
        if isinstance(x, list):
            return [norm(v) for v in x]
        if isinstance(x, dict):
            return {k: norm(v) for k, v in x.items()}
        return x

    ref, warm = norm(ref), norm(warm)
    assert ref["torch_at_start"] is (not cold) and warm["torch_at_start"] is True  # cold vs warm indeed
    assert {k: warm[k] for k in SAME} == {k: ref[k] for k in SAME}
    assert warm["name"] == "__main__" and warm["main_is_me"] and warm["pickle"] == 3
    changed = {k for k in ref["env"].keys() | warm["env"].keys() if ref["env"].get(k) != warm["env"].get(k)}
    allowed = PER_INCARNATION | (PER_JOB if jobs is not None else set())
    assert changed <= allowed, changed - allowed


@pytest.fixture(scope="module")
def cold_job(tmp_path_factory):
    """The probe job with ``--no-standby``: both incarnations start fresh interpreters."""
    job_dir = tmp_path_factory.mktemp("cold")
    job = robust_run(job_dir, 2, "--no-standby", *KILL,
                     script=[PROBE, *PROBE_ARGS, "--probe-dir", str(job_dir / "probe")])
    assert job.returncode == 0, job.output[-3000:]
    return job, job_dir, _probes(job_dir / "probe")


def _forked_by(run_dir: Path, probe: dict) -> int:
    """The fork server that forked the warm rank of ``probe`` (its parent), from standbys.jsonl."""
    (spawned,) = [e for e in _events(run_dir) if e["event"] == "spawned" and e["pid"] == probe["pid"]]
    assert spawned["zygote"] == probe["ppid"], (spawned, probe["ppid"])
    return spawned["zygote"]


def test_every_incarnation_is_served_by_standbys_running_the_script_as_a_fresh_process(tmp_path, cold_job):
    _, cold_dir, cold = cold_job
    probe = tmp_path / "probe"
    job = robust_run(tmp_path, 2, *KILL, script=[PROBE, *PROBE_ARGS, "--probe-dir", str(probe)])
    assert job.returncode == 0, job.output[-3000:]
    (fault,) = job.faults
    assert (fault["kind"], fault["suspect_ranks"], fault["action"]) == ("crash", [1], "restart")
    detail = fault["detail"]
    assert detail["standby"] is True and detail["standby_ranks"] == [0, 1]
    assert 0 <= detail["restart_s"] <= detail["recovered_after_s"]
    probes = _probes(probe)
    assert sorted(probes) == sorted(cold) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for key in probes:
        _same_start(cold[key], probes[key], jobs=(cold_dir, tmp_path))
    served = [(e["rank"], e["pid"]) for e in _events(tmp_path) if e["event"] == "served"]
    assert served == [(r, probes[(i, r)]["pid"]) for i in (0, 1) for r in (0, 1)]
    # Each incarnation's ranks came from one fork server that imported once and never ran the
    # script; numpy's global RNG, seeded at its import there, was reseeded in each child.
    (zygote,) = {_forked_by(tmp_path, probes[key]) for key in probes}
    assert [e["pid"] for e in _events(tmp_path) if e["event"] == "zygote_ready"][0] == zygote
    assert len({probes[key]["numpy_draw"] for key in probes}) == 4
    # Module-level side effects ran once per incarnation and rank: the standbys that were
    # started after the restart (and stopped unused at the end) ran nothing of the script.
    lines = sorted((probe / "side_effects.txt").read_text().split("\n")[:-1])
    assert lines == sorted(f"{i} {r} {probes[(i, r)]['pid']}" for i in (0, 1) for r in (0, 1))
    assert any(e["event"] == "stopped" for e in _events(tmp_path))


def _wait(what, predicate, timeout_s: float, proc: subprocess.Popen, log: Path):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}:\n{log.read_text(errors='replace')[-3000:]}")


def test_dead_and_hung_standbys_and_fork_servers_are_replaced_and_none_outlives_a_sigkilled_launcher(tmp_path):
    """Also the ``-m module`` form. One standby is SIGKILLed, the other SIGSTOPped (it stops
    answering pings); both are replaced. Then the fork server is SIGSTOPped (replaced, its
    standbys with it), and its successor SIGKILLed (replaced too). The third one's standbys serve
    the restart after a rank dies; then the launcher is SIGKILLed: nothing is left, fork servers
    and the ranks they forked included."""
    probe, run_dir = tmp_path / "probe", tmp_path / "run"
    cmd = [sys.executable, "-m", "robust_plugins.cli.main", "run", "--run-dir", str(run_dir), "--standalone",
           "--nproc-per-node", "2", "--monitor-interval", "0.1", "--watchdog", "straggler_factor=0",
           "-m", "standby_probe", "--steps", "100000", "--step-sleep", "0.05", "--probe-dir", str(probe)]
    env = launch_env(extra={"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])})
    run_dir.mkdir()
    log = run_dir / "launcher.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
    pids: set[int] = set()
    try:
        def ready(zygote: int | None = None) -> list[int]:
            ev = _events(run_dir)
            gone = {e["pid"] for e in ev if e["event"] in ("died", "hung", "served", "stopped")}
            return [e["pid"] for e in ev if e["event"] == "ready" and e["pid"] not in gone
                    and (zygote is None or e.get("zygote") == zygote)]

        def zygotes(event: str) -> list[int]:
            return [e["pid"] for e in _events(run_dir) if e["event"] == event]

        first = _wait("two ready standbys", lambda: len(ready()) == 2 and ready(), 150, proc, log)
        pids.update(first)
        os.kill(first[0], signal.SIGKILL)
        os.kill(first[1], signal.SIGSTOP)
        events = _wait("both replaced and ready",
                       lambda: (len(set(ready()) - set(first)) == 2) and _events(run_dir), 150, proc, log)
        fate = {e["pid"]: e for e in events if e["pid"] in first and e["event"] in ("died", "hung")}
        assert fate[first[0]]["event"] == "died"
        assert fate[first[1]]["event"] == "hung" and "ping" in fate[first[1]]["why"]
        (z1,) = zygotes("zygote_ready")
        assert all(e.get("zygote") == z1 for e in events if e["event"] == "ready")
        os.kill(z1, signal.SIGSTOP)  # a hung fork server: replaced, its idle standbys with it
        z2 = _wait("a second fork server", lambda: len(zygotes("zygote_ready")) == 2 and zygotes("zygote_ready")[1],
                   150, proc, log)
        _wait("its two standbys", lambda: len(ready(z2)) == 2, 60, proc, log)
        (hung,) = [e for e in _events(run_dir) if e["event"] == "zygote_hung"]
        # The first incarnation's ranks run in processes it forked: it drains (no new forks)
        # until they end, instead of taking them down with it.
        first_ranks = [json.loads(x) for x in (run_dir / "workers.jsonl").read_text().splitlines()][0]
        assert hung["pid"] == z1 and "ping" in hung["why"] and _alive(z1)
        assert sorted(hung["draining"]) == sorted(first_ranks["pids"].values())
        os.kill(z2, signal.SIGKILL)  # a dead one: replaced
        z3 = _wait("a third fork server", lambda: len(zygotes("zygote_ready")) == 3 and zygotes("zygote_ready")[2],
                   150, proc, log)
        _wait("its two standbys", lambda: len(ready(z3)) == 2, 60, proc, log)
        assert zygotes("zygote_died") == [z2]
        workers = [json.loads(x) for x in (run_dir / "workers.jsonl").read_text().splitlines()]
        os.kill(workers[0]["pids"]["1"], signal.SIGKILL)  # a real crash of rank 1
        _wait("the warm incarnation's first steps", lambda: (run_dir / "faults.jsonl").exists(), 60, proc, log)

        def forked_after_the_restart() -> bool:
            ev = [e["event"] for e in _events(run_dir)]
            return "served" in ev and ev[ev.index("served"):].count("spawned") >= 2

        _wait("standbys forked after the restart", forked_after_the_restart, 60, proc, log)
        _wait("the hung fork server stopped once its ranks ended",
              lambda: z1 in zygotes("zygote_stopped") and not _alive(z1), 30, proc, log)
        workers = [json.loads(x) for x in (run_dir / "workers.jsonl").read_text().splitlines()]
        pids.update(p for w in workers for p in w["pids"].values())
        pids.update(e["pid"] for e in _events(run_dir) if e["pid"] is not None)
        assert _alive(z3) and {z1, z2, z3} <= pids
        # A stopped standby cannot notice its closed hand-off pipe: only PR_SET_PDEATHSIG ends it.
        os.kill(_wait("a ready standby after the restart", lambda: ready(z3), 60, proc, log)[0], signal.SIGSTOP)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.1)
        assert not [p for p in pids if _alive(p)], "processes outlived the SIGKILLed launcher"
    finally:
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    (fault,) = [json.loads(x) for x in (run_dir / "faults.jsonl").read_text().splitlines()]
    assert fault["kind"] == "crash" and fault["detail"]["standby"] is True
    probes = _probes(probe)
    for rank in (0, 1):
        _same_start(probes[(0, rank)], probes[(1, rank)], cold=False)
        assert _forked_by(run_dir, probes[(0, rank)]) == z1
        assert _forked_by(run_dir, probes[(1, rank)]) == z3
        assert probes[(1, rank)]["spec"] == "standby_probe" and probes[(1, rank)]["argv"][0].endswith("standby_probe.py")


FORK_UNSAFE = """\
# A stand-in for a site hook that starts a thread in every interpreter (a telemetry agent, say).
import threading, time
threading.Thread(target=time.sleep, args=(3600,), daemon=True, name="site-hook").start()
"""


def test_where_forking_is_unsafe_standbys_are_spawned_and_say_why(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FORK_UNSAFE)
    probe = tmp_path / "probe"
    job = robust_run(tmp_path / "run", 2, "--inject", "kill:rank=0,step=6",
                     env={"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])},
                     script=[PROBE, "--steps", "12", "--step-sleep", "0.05", "--probe-dir", str(probe)])
    assert job.returncode == 0, job.output[-3000:]
    (fault,) = job.faults
    assert fault["detail"]["standby"] is True and fault["detail"]["standby_ranks"] == [0, 1]
    events = _events(tmp_path / "run")
    (unsafe,) = [e for e in events if e["event"] == "zygote_unsafe"]
    assert "site-hook" in unsafe["why"] and "2 Python threads" in unsafe["why"]
    assert "forking standbys is unsafe here" in job.output and "site-hook" in job.output
    served = {e["pid"] for e in events if e["event"] == "served"}
    spawned = {e["pid"]: e for e in events if e["event"] == "spawned"}
    assert served and all("zygote" not in spawned[p] for p in served)  # spawned, not forked
    probes = _probes(probe)
    assert len(served) == 4  # both incarnations
    for rank in (0, 1):
        _same_start(probes[(0, rank)], probes[(1, rank)], cold=False)
        assert probes[(1, rank)]["ppid"] == probes[(0, rank)]["ppid"]  # the agent's children both


def test_no_standby_restarts_cold(cold_job):
    job, job_dir, probes = cold_job
    (fault,) = job.faults
    assert fault["detail"]["standby"] is False and fault["detail"]["standby_ranks"] == []
    assert not (job_dir / "standbys.jsonl").exists()
    assert sorted(probes) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert not any(p["torch_at_start"] for p in probes.values())
