"""SLURM: host-list expansion, what `robust run` under srun takes from the step, flags winning."""

from __future__ import annotations

import pytest

from robust_plugins.cli.main import build_parser
from robust_plugins.cli.run import apply_slurm
from robust_plugins.errors import ConfigError
import json

from robust_plugins.launcher.slurm import (
    SCHEDULER_FILE, SlurmError, drain_command, drain_excluded, expand_hostlist, nodes_to_drain, rendezvous_settings,
    requeue_decision, requeue_job, slurm_step,
)


@pytest.mark.parametrize("spec, hosts", [
    ("node01", ["node01"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("a[8-11]", ["a8", "a9", "a10", "a11"]),
    ("a[098-101]", ["a098", "a099", "a100", "a101"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("pre[1,3]-ib,x", ["pre1-ib", "pre3-ib", "x"]),
    ("n[0]", ["n0"]),
])
def test_expand_hostlist(spec, hosts):
    assert expand_hostlist(spec) == hosts


def test_expand_hostlist_large():
    hosts = expand_hostlist("gpu[0001-1024],login[1-2]")
    assert len(hosts) == 1026 and hosts[0] == "gpu0001" and hosts[1023] == "gpu1024" and hosts[-1] == "login2"


@pytest.mark.parametrize("spec, says", [
    ("", "empty"), ("n[1-3", "never closed"), ("n1-3]", "without '['"), ("n[[1]]", "nested"),
    ("n[3-1]", "backwards"), ("n[a-b]", "not N or N-M"), ("a,,b", "empty name"),
])
def test_expand_hostlist_refuses(spec, says):
    with pytest.raises(ConfigError, match=says.replace("[", r"\[")):
        expand_hostlist(spec)


def _env(node_id: int = 1, **extra: str) -> dict[str, str]:
    return {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_NNODES": "3", "SLURM_NODEID": str(node_id),
            "SLURM_NTASKS": "3", "SLURM_JOB_NODELIST": "gpu[07-09]", "SLURMD_NODENAME": f"gpu0{7 + node_id}",
            **extra}


def test_step_outside_srun_is_none():
    assert slurm_step({}) is None
    batch_script = _env()
    del batch_script["SLURM_STEP_ID"]  # the sbatch script itself: one process, not one per node
    assert slurm_step(batch_script) is None


def test_step_refuses_several_tasks_a_node():
    with pytest.raises(SlurmError, match="SLURM_NTASKS = 24 .* --ntasks-per-node=1"):
        slurm_step(_env(SLURM_NTASKS="24"))


def test_rendezvous_from_step():
    step = slurm_step(_env(node_id=0))
    assert step.hosts == ("gpu07", "gpu08", "gpu09") and step.node_name == "gpu07"
    got = rendezvous_settings(step, set())
    assert got == {"rdzv_backend": "c10d", "rdzv_endpoint": "gpu07:29642", "rdzv_id": "slurm-4242",
                   "nnodes": "3", "rdzv_conf": "is_host=true"}
    other = rendezvous_settings(slurm_step(_env(node_id=2)), {"nnodes", "rdzv_conf"}, rdzv_conf="join_timeout=60",
                                spares=1)
    assert other == {"rdzv_backend": "c10d", "rdzv_endpoint": "gpu07:29642", "rdzv_id": "slurm-4242",
                     "rdzv_conf": "join_timeout=60,is_host=false"}
    with pytest.raises(SlurmError, match="at least one node must train"):
        rendezvous_settings(step, set(), spares=3)


def _args(*argv: str):
    return build_parser("run").parse_args(["run", *argv, "train.py"])


def test_apply_slurm_fills_what_is_not_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = _args("--nproc-per-node", "8")
    line = apply_slurm(args, _env(node_id=1))
    assert (args.nnodes, args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id) == ("3", "c10d", "gpu07:29642",
                                                                                  "slurm-4242")
    assert args.rdzv_conf == "is_host=false" and args.slurm_node == "gpu08" and not args.spare
    assert args.run_dir == "runs/slurm-4242/gpu08" and "took" in line


def test_apply_slurm_explicit_flags_win(monkeypatch):
    # --nnodes given equal to torchrun's default (1:1) still wins: "given" is the flag, not the value.
    args = _args("--nnodes", "1:1", "--rdzv-endpoint", "head:1234", "--run-dir", "mine")
    apply_slurm(args, _env(node_id=0))
    assert (args.nnodes, args.rdzv_endpoint, args.rdzv_backend, args.run_dir) == ("1:1", "head:1234", "c10d",
                                                                                  "mine")
    monkeypatch.setenv("PET_RDZV_ID", "from-env")
    args = _args("--rdzv-id", "from-env")
    apply_slurm(args, {**_env(node_id=0), "PET_RDZV_ID": "from-env"})
    assert args.rdzv_id == "from-env"


def test_apply_slurm_spares_and_outside():
    args = _args("--slurm-spares", "1")
    apply_slurm(args, _env(node_id=2))
    assert args.spare and args.nnodes == "2"
    with pytest.raises(ConfigError, match="need a SLURM step"):
        apply_slurm(_args("--slurm-spares", "1"), {})
    plain = _args()
    assert apply_slurm(plain, {}) is None and plain.nnodes == "1:1" and plain.rdzv_backend == "static"


def test_drain_command_and_pending():
    assert drain_command("gpu08", "blamed twice") == ["scontrol", "update", "NodeName=gpu08", "State=DRAIN",
                                                      "Reason=robust_plugins: blamed twice"]
    with pytest.raises(SlurmError, match="not a SLURM node name"):
        drain_command("gpu08 State=IDLE", "x")
    assert nodes_to_drain([{"node": "a"}, {"node": "b"}, {"node": "a"}], {"b"}) == ["a"]


def test_requeue_only_node_0_only_when_asked_and_bounded():
    step0, step1 = slurm_step(_env(node_id=0)), slurm_step(_env(node_id=1))
    assert requeue_decision(step0, {}, 2) is None
    assert requeue_decision(step0, {"SLURM_RESTART_COUNT": "1"}, 2) is None
    assert "requeued 2 time(s) already" in requeue_decision(step0, {"SLURM_RESTART_COUNT": "2"}, 2)
    assert "not given" in requeue_decision(step0, {}, 0)
    assert "not node 0" in requeue_decision(step1, {}, 2)
    assert requeue_decision(None, {}, 2) == "not a SLURM step"


def _failing(argv):
    raise SlurmError(f"`{' '.join(argv)}` failed (exit 1): Invalid node name specified")


def test_scheduler_actions_are_recorded_whether_or_not_scontrol_succeeds(tmp_path):
    ran = []
    ok = drain_excluded({"node": "gpu08", "blames": 2, "reason": "rank 3 died by SIGKILL"}, tmp_path, runner=ran.append)
    bad = drain_excluded({"node": "gpu09", "blames": 2, "reason": "x"}, tmp_path, runner=_failing)
    req = requeue_job(slurm_step(_env(node_id=0)), tmp_path, "restart budget exhausted", runner=ran.append)
    assert ran == [drain_command("gpu08", "blamed 2 times by robust run; last: rank 3 died by SIGKILL"),
                   ["scontrol", "requeue", "4242"]]
    lines = [json.loads(x) for x in (tmp_path / SCHEDULER_FILE).read_text().splitlines()]
    assert [(x["action"], x["node"], x["ok"]) for x in lines] == [("drain", "gpu08", True), ("drain", "gpu09", False),
                                                                   ("requeue", "gpu07", True)]
    assert "Invalid node name" in lines[1]["error"] and ok["ok"] and not bad["ok"] and req["ok"]
