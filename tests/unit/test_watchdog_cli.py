"""``robust run`` argument handling without launching anything."""

from __future__ import annotations

import json

import pytest

from robust_plugins.cli import run as run_cmd
from robust_plugins.cli.main import build_parser
from robust_plugins.errors import ConfigError


def _parse(argv):
    return build_parser("run").parse_args(["run", *argv])


def test_torchrun_options_parse_unchanged_next_to_ours():
    args = _parse(["--run-dir", "r", "--inject", "kill:rank=1,step=3", "--nnodes", "1:2",
                   "--nproc-per-node", "4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:29400",
                   "--max-restarts", "3", "--monitor-interval", "0.5", "train.py", "--lr", "1e-3"])
    assert (args.nnodes, args.nproc_per_node) == ("1:2", "4")
    assert (args.rdzv_backend, args.rdzv_endpoint) == ("c10d", "h:29400")
    assert args.max_restarts == 3 and args.monitor_interval == 0.5
    assert args.training_script == "train.py" and args.training_script_args == ["--lr", "1e-3"]
    assert args.inject == ["kill:rank=1,step=3"] and args.run_dir == "r"


def test_standalone_and_single_node_defaults_match_torchrun():
    args = _parse(["--standalone", "--nproc-per-node", "2", "t.py"])
    run_cmd._resolve_rendezvous(args)
    assert (args.rdzv_backend, args.rdzv_endpoint) == ("c10d", "localhost:0")
    args = _parse(["--nproc-per-node", "2", "--master-port", "1234", "t.py"])
    run_cmd._resolve_rendezvous(args)
    assert (args.rdzv_backend, args.master_port) == ("static", 1234)


def test_watchdog_settings_from_a_deepspeed_config_and_the_command_line(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8,
                                "robust_plugins": {"watchdog": {"hang_factor": 4, "nan_check": False}}}))
    cfg = run_cmd.watchdog_config(str(path), ["hang_factor=6", "hang_min_timeout_s=5"])
    assert (cfg.hang_factor, cfg.nan_check, cfg.hang_min_timeout_s) == (6, False, 5)
    with pytest.raises(ConfigError, match="--watchdog 'hang_factor' must be KEY=VALUE"):
        run_cmd.watchdog_config(None, ["hang_factor"])
    with pytest.raises(ConfigError, match="Did you mean 'hang_factor'"):
        run_cmd.watchdog_config(None, ["hang_facter=3"])


def test_default_run_dirs_never_collide(tmp_path, monkeypatch):
    monkeypatch.setattr(run_cmd.time, "strftime", lambda fmt: "run-20260101-000000")
    first = run_cmd._new_run_dir(tmp_path)
    first.mkdir()
    second = run_cmd._new_run_dir(tmp_path)
    assert first.name == "run-20260101-000000" and second.name == "run-20260101-000000-1"


def test_restarts_are_on_by_default_and_the_help_says_so(monkeypatch, capsys):
    monkeypatch.delenv("PET_MAX_RESTARTS", raising=False)
    assert _parse(["t.py"]).max_restarts == run_cmd.DEFAULT_MAX_RESTARTS == 3
    assert _parse(["--max-restarts", "0", "t.py"]).max_restarts == 0
    monkeypatch.setenv("PET_MAX_RESTARTS", "7")  # torchrun's environment fallback still works
    assert _parse(["t.py"]).max_restarts == 7
    monkeypatch.setenv("PET_MAX_RESTARTS", "many")
    with pytest.raises(SystemExit):
        _parse(["t.py"])
    assert "invalid int value: 'many'" in capsys.readouterr().err
    monkeypatch.delenv("PET_MAX_RESTARTS")
    with pytest.raises(SystemExit):
        _parse(["--help"])
    assert "(default 3; torchrun's is 0)" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("argv, says", [
    (["--standalone", "--nproc-per-node", "2"], "--spare needs --rdzv-backend c10d"),
    (["--nnodes", "2:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:29400",
      "--rdzv-conf", "is_host=true"], "must not host the rendezvous store"),
    (["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:29400"], "needs a multi-node job"),
])
def test_spare_refuses_a_job_it_could_not_serve(argv, says):
    from torch.distributed.run import config_from_args

    from robust_plugins.launcher.agent import check_spare

    args = _parse(["--spare", *argv, "t.py"])
    run_cmd._resolve_rendezvous(args)
    config, _, _ = config_from_args(args)
    with pytest.raises(ConfigError, match=says):
        check_spare(config)


def test_spare_accepts_a_c10d_multi_node_job():
    from torch.distributed.run import config_from_args

    from robust_plugins.launcher.agent import check_spare

    args = _parse(["--spare", "--nnodes", "2:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:29400", "t.py"])
    assert args.spare
    run_cmd._resolve_rendezvous(args)
    check_spare(config_from_args(args)[0])
