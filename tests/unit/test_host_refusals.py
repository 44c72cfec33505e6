"""Refusals that help: an unsupported host turns off only the plugin's parts for it, says so once,
and each path (Trainer, Accelerate, W&B alignment, megatron, check-config) refuses for its own
reason, in its own terms. The versions the guards read are faked; nothing here starts a process."""

from __future__ import annotations

import json
import logging
import types

import pytest

from robust_plugins import _logging
from robust_plugins.config import PluginConfig
from robust_plugins.errors import UnsupportedError
from robust_plugins.patches import _guard, _ranges


def _under(r) -> str:
    """A version just below ``r``'s range (``0.16.0`` -> ``0.15.9``)."""
    return f"{r.minimum[0]}.{r.minimum[1] - 1}.9"


OLD_DS, OLD_TF, OLD_ACC = _under(_ranges.DEEPSPEED), _under(_ranges.TRANSFORMERS), _under(_ranges.ACCELERATE)


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(_logging, "_WARNED", set())
    monkeypatch.delenv("RANK", raising=False)


def _plugin(block: dict):
    return types.SimpleNamespace(config=PluginConfig.from_dict(block), memory=None)


def _built_by(owner, fn):
    """Call ``fn`` under a frame whose ``self`` is ``owner``, as ``Trainer._inner_training_loop`` or
    ``Accelerator.prepare`` build an engine."""
    def method(self):
        return fn()

    return method(owner)


def test_host_off_warns_once_per_host_on_rank_0(fresh_warnings, caplog, monkeypatch):
    err = _ranges.DEEPSPEED.error(OLD_DS)
    with caplog.at_level(logging.WARNING, logger="robust_plugins"):
        _guard.host_off("deepspeed", err, "the block")
        _guard.host_off("deepspeed", err, "the block")
    (record,) = caplog.records
    assert f"found deepspeed {OLD_DS}" in record.getMessage() and _ranges.DEEPSPEED.spec in record.getMessage()
    assert "Off: the block" in record.getMessage()
    monkeypatch.setenv("RANK", "3")
    caplog.clear()
    _guard.host_off("megatron-core", err, "x")  # other ranks stay quiet
    assert not caplog.records


def test_each_host_names_its_own_action():
    ds = str(_ranges.DEEPSPEED.error(OLD_DS))
    assert "remove the robust_plugins block from your DeepSpeed config" in ds
    mc = str(_ranges.MEGATRON.error(_under(_ranges.MEGATRON)))
    assert "rpm.enable" in mc and "config" not in mc.replace("DeepSpeed config", "")
    assert "Python >= 3.12" in str(_ranges.MEGATRON.error("0.17.0")) and "Python" not in mc
    th = str(_ranges.TORCH_ELASTIC.error("2.15.0"))
    assert "pip install" not in th and "never replaces your torch" in th and "torchrun" in th
    assert "Accelerate loop" in str(_ranges.ACCELERATE.error(OLD_ACC))
    assert "save_strategy" in str(_ranges.TRANSFORMERS.error(OLD_TF))


def test_megatron_enable_refuses_with_rpm_enable_not_a_config_block(monkeypatch):
    pytest.importorskip("megatron.core")
    from megatron.core import package_info

    from robust_plugins import megatron as rpm

    monkeypatch.setattr(package_info, "__version__", "0.17.0")
    with pytest.raises(_guard.HostVersionError) as info:
        rpm.enable(object(), {"compression": {"codec": "int8"}})
    msg = str(info.value)
    assert "found megatron-core 0.17.0" in msg and "rpm.enable" in msg and "Python >= 3.12" in msg


@pytest.fixture
def trainer_off(monkeypatch, fresh_warnings):
    """The Trainer binding as on a transformers below the range: nothing patched, the reason kept."""
    pytest.importorskip("transformers")
    from robust_plugins.patches import transformers_trainer as tt

    monkeypatch.setattr(tt, "_INSTALL_ERROR", _ranges.TRANSFORMERS.error(OLD_TF))
    return tt


def _trainer(report_to):
    from transformers.trainer import Trainer

    trainer = Trainer.__new__(Trainer)  # isinstance is all the guard asks; no model needed
    trainer.args = types.SimpleNamespace(report_to=report_to)
    return trainer


def test_trainer_off_refuses_a_checkpoint_block_only_under_a_trainer(trainer_off):
    plugin = _plugin({"checkpoint": {"memory_every": 1}})
    assert trainer_off.bind_engine(None, plugin) is None  # a plain script or Accelerate loop: not the Trainer's reason
    with pytest.raises(UnsupportedError, match=rf"under the Hugging Face Trainer.*found transformers {OLD_TF}"):
        _built_by(_trainer([]), lambda: trainer_off.bind_engine(None, plugin))


def test_trainer_off_says_the_wandb_alignment_is_off(trainer_off, caplog):
    plugin = _plugin({"telemetry": {"wandb": {"project": "p", "mode": "offline"}}})
    with caplog.at_level(logging.WARNING, logger="robust_plugins"):
        assert _built_by(_trainer(["wandb"]), lambda: trainer_off.bind_engine(None, plugin)) is None
        _built_by(_trainer(["wandb"]), lambda: trainer_off.bind_engine(None, plugin))
    (record,) = caplog.records
    assert "W&B alignment" in record.getMessage() and "'p'" in record.getMessage()
    assert f"found transformers {OLD_TF}" in record.getMessage()


def test_trainer_off_install_warns_what_is_off(monkeypatch, fresh_warnings, caplog):
    transformers = pytest.importorskip("transformers")
    from robust_plugins.patches import transformers_trainer as tt

    tt.undo()
    monkeypatch.setattr(transformers, "__version__", OLD_TF)
    try:
        with caplog.at_level(logging.WARNING, logger="robust_plugins"):
            tt.install()
        (record,) = caplog.records
        assert f"found transformers {OLD_TF}" in record.getMessage() and "W&B" in record.getMessage()
    finally:
        monkeypatch.undo()
        tt._INSTALL_ERROR = None
        tt.install()


def test_accelerate_off_refuses_its_own_loop_not_a_trainers(monkeypatch, fresh_warnings, caplog):
    accelerate = pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from robust_plugins.patches import accelerate as guard

    monkeypatch.setattr(accelerate, "__version__", OLD_ACC)
    with caplog.at_level(logging.WARNING, logger="robust_plugins"):
        guard.install()
    assert f"found accelerate {OLD_ACC}" in caplog.records[0].getMessage()
    monkeypatch.setattr(guard, "_PROBLEM", guard._PROBLEM)  # restored after the test
    plugin = _plugin({"checkpoint": {"memory_every": 1}})
    accelerator = Accelerator.__new__(Accelerator)
    with pytest.raises(UnsupportedError, match=rf"in an Accelerate loop.*found accelerate {OLD_ACC}"):
        _built_by(accelerator, lambda: guard.bind_engine(None, plugin))
    guard.bind_engine(None, plugin)  # no Accelerator building it: nothing to refuse
    guard.bind_engine(None, _plugin({"compression": {"codec": "int8"}}))  # DeepSpeed's business
    pytest.importorskip("transformers")
    trainer = _trainer([])
    _built_by(trainer, lambda: _built_by(accelerator, lambda: guard.bind_engine(None, plugin)))


def test_check_config_reports_an_unsupported_deepspeed(monkeypatch, tmp_path):
    from robust_plugins.cli import check_config

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"robust_plugins": {"compression": {"codec": "int8"}}}))
    monkeypatch.setattr(_guard, "installed_version", lambda dist: OLD_DS if dist == "deepspeed" else None)
    errors = [x for x in check_config.check(str(path)) if "ERROR" in x]
    assert len(errors) == 1 and f"found deepspeed {OLD_DS}" in errors[0] and "will refuse" in errors[0]
    monkeypatch.setattr(_guard, "installed_version", lambda dist: ".".join(map(str, _ranges.DEEPSPEED.minimum)))
    assert not [x for x in check_config.check(str(path)) if "ERROR" in x]
