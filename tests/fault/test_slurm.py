"""`robust run` under a real SLURM (slurmctld + one slurmd per simulated node, munge), as root.

The CPU recipe's sbatch script (recipes/slurm/cpu_plain_gpt.sbatch) is submitted unchanged; every
agent takes its rendezvous from the SLURM step. Three nodes in one cluster for the module: the
fault-free job runs on two, the faulted job on all three (the third a hot spare).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from robust_plugins.launch import launch_env
from robust_plugins.sim.netns import IFNAME, list_namespaces
from robust_plugins.sim.slurm import SlurmSim

from _slurm import need_slurm

pytestmark = [pytest.mark.fault, pytest.mark.distributed, pytest.mark.timeout(400)]

SBATCH = str(Path(__file__).parents[2] / "recipes" / "slurm" / "cpu_plain_gpt.sbatch")
STEPS = 24
#: Rank 0 sleeps 0.3 s a step (the other waits for it in the all-reduce): a 24-step job lasts
#: ~7 s of training, long enough to kill a rank twice at chosen steps. A `slow` injection fires
#: once per job and paces the rest of its incarnation only: one at every step paces a restarted
#: incarnation again from the first step it has not replayed.
PACE = ("--inject " + ";".join(f"slow:rank=0,step={s},seconds=0.3" for s in range(1, STEPS + 1))
        + " --watchdog straggler_factor=0")
#: As tests/fault/test_multinode.py: a lost node leaves the rendezvous in ~6 s, late nodes get 3 s.
RDZV = "--rdzv-conf last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=6,join_timeout=60"
FLAGS = f"{PACE} {RDZV} --max-restarts 4 --monitor-interval 0.1 --no-standby"


@pytest.fixture(scope="module")
def slurm():
    need_slurm()
    with SlurmSim(nodes=3) as cluster:
        yield cluster
    assert not cluster.cluster.exists() and not any(n.startswith(cluster.cluster.name) for n in list_namespaces())


def _submit(slurm: SlurmSim, workdir: Path, nodes: int, extra: str = "") -> str:
    env = {**launch_env(), "ROBUST": f"{sys.executable} -m robust_plugins.cli.main", "WORKDIR": str(workdir),
           "GLOO_SOCKET_IFNAME": IFNAME, "STEPS": str(STEPS), "SAVE_EVERY": "2", "ROBUST_RUN_ARGS": f"{FLAGS} {extra}"}
    return slurm.sbatch([f"--nodes={nodes}", "-o", str(workdir.parent / f"{workdir.name}.out"), SBATCH],
                        cwd=workdir.parent, env=env)


def _output(workdir: Path) -> str:
    return (workdir.parent / f"{workdir.name}.out").read_text(errors="replace")


@pytest.fixture(scope="module")
def fault_free(slurm, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("slurm") / "clean"
    job = _submit(slurm, workdir, nodes=2)
    info = slurm.wait_job(job, timeout_s=150)
    return job, info, workdir


def test_two_node_job_runs_the_cpu_recipe_under_srun_robust_run(fault_free):
    job, info, workdir = fault_free
    out = _output(workdir)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), out[-3000:]
    # Each agent took the rendezvous from SLURM: one c10d round of 2 nodes, endpoint on node0.
    for i, node in enumerate(("node0", "node1")):
        assert (f"SLURM job {job}, node {node} ({i + 1} of 2): took nnodes=2, rdzv_backend=c10d, "
                f"rdzv_conf=last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=6,join_timeout=60,"
                f"is_host={'true' if i == 0 else 'false'}, rdzv_endpoint=node0:{29400 + int(job) % 1000}, "
                f"rdzv_id=slurm-{job}") in out, out[-3000:]
        rounds = [json.loads(x) for x in (workdir / "runs" / f"slurm-{job}" / node / "membership.jsonl")
                  .read_text().splitlines()]
        assert [(r["node"], r["group_rank"], r["world_size"]) for r in rounds] == [(node, i, 2)]
    result = json.loads((workdir / "result.json").read_text())
    assert result["steps"] == STEPS and result["started_at"] == 1


def _steps_saved(workdir: Path) -> int:
    names = [p.name for p in (workdir / "ckpt").glob("step-*.pt")] if (workdir / "ckpt").is_dir() else []
    return max((int(n[5:13]) for n in names), default=0)


def _kill_rank_of(run_dir: Path) -> int:
    """SIGKILLs the ranks of the node's newest incarnation; returns how many were still alive (0:
    that incarnation was already being replaced when we read its line)."""
    pids = json.loads((run_dir / "workers.jsonl").read_text().splitlines()[-1])["pids"]
    killed = 0
    for pid in pids.values():
        try:
            os.kill(int(pid), signal.SIGKILL)
            killed += 1
        except ProcessLookupError:
            pass
    return killed


def test_node_killed_twice_is_drained_and_the_spare_finishes_with_the_same_weights(slurm, fault_free, tmp_path):
    workdir = tmp_path / "faulted"
    job = _submit(slurm, workdir, nodes=3, extra="--slurm-spares 1")
    node1 = workdir / "runs" / f"slurm-{job}" / "node1"
    deadline = time.monotonic() + 240
    killed_at = []
    for at_least in (4, None):  # node1's rank: SIGKILLed at step >= 4, then 4 steps after its restart
        want = at_least or killed_at[-1] + 4
        incarnations = len((node1 / "workers.jsonl").read_text().splitlines()) if killed_at else 0
        while time.monotonic() < deadline:
            state = slurm.job(job).get("JobState")
            assert state in ("PENDING", "RUNNING", "CONFIGURING"), (state, _output(workdir)[-3000:])
            fresh = (node1 / "workers.jsonl").exists() and \
                len((node1 / "workers.jsonl").read_text().splitlines()) > incarnations
            if fresh and _steps_saved(workdir) >= want:
                if _kill_rank_of(node1):
                    break
                incarnations = len((node1 / "workers.jsonl").read_text().splitlines())  # wait for the next
            time.sleep(0.1)
        else:
            pytest.fail(f"node1 never reached step {want} with live ranks: {_output(workdir)[-3000:]}")
        killed_at.append(_steps_saved(workdir))
    info = slurm.wait_job(job, timeout_s=max(10.0, deadline - time.monotonic()))
    out = _output(workdir)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), out[-4000:]
    # node1 was excluded by the job and drained in SLURM; sinfo shows it.
    assert "EXCLUDED NODE node1" in out and "node node1 DRAINED in SLURM" in out, out[-4000:]
    assert slurm.node_states()["node1"] in ("drain", "drng"), slurm.node_states()
    drained = [json.loads(x) for x in (node1 / "scheduler.jsonl").read_text().splitlines()]
    assert [(d["action"], d["node"], d["ok"]) for d in drained] == [("drain", "node1", True)]
    # The spare (node2) replaced it: the last round is node0 + node2, world size kept.
    rounds = [json.loads(x) for x in (workdir / "runs" / f"slurm-{job}" / "node2" / "membership.jsonl")
              .read_text().splitlines()]
    assert rounds[-1]["world_size"] == 2 and rounds[-1]["node"] == "node2"
    # Same weights as the fault-free job, bitwise (deterministic CPU recipe, batches by step and rank).
    clean = json.loads((fault_free[2] / "result.json").read_text())
    result = json.loads((workdir / "result.json").read_text())
    assert result["steps"] == STEPS and result["params_hash"] == clean["params_hash"]
    assert result["final_loss"] == clean["final_loss"]
