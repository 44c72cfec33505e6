"""``robust_plugins.Snapshotter`` in one process (no process group): refusals, and a restore into
fresh objects that continues bitwise. The multi-rank kills under ``robust run`` are in
``tests/fault/test_plain_memory.py``."""

from __future__ import annotations

import uuid

import pytest
import torch

import robust_plugins
from robust_plugins.checkpoint import memory
from robust_plugins.errors import CheckpointError, ConfigError, UnsupportedError


@pytest.fixture
def job(monkeypatch):
    job_id = f"unit-snapshotter-{uuid.uuid4().hex}"
    monkeypatch.setenv("ROBUST_JOB_ID", job_id)
    monkeypatch.delenv("ROBUST_RUN_DIR", raising=False)
    yield job_id
    memory.remove_job(memory.job_key(job_id))


def _loop(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _train(model, opt, snap, steps, data):
    for step in steps:
        g = torch.Generator().manual_seed(step)
        loss = model(torch.randn(3, 4, generator=g)).pow(2).mean()  # dropout draws from torch's RNG
        opt.zero_grad()
        loss.backward()
        opt.step()
        data["pos"] += 1
        if snap is not None:
            snap.step_end(step, loss=loss.item())


def test_a_restore_into_fresh_objects_continues_bitwise(job):
    ref_model, ref_opt = _loop()
    _train(ref_model, ref_opt, None, range(1, 6), {"pos": 0})

    model, opt = _loop()
    data = {"pos": 0}
    snap = robust_plugins.Snapshotter(model, opt)  # memory_every defaults to 1
    snap.register("data", lambda: dict(data), data.update)
    assert snap.restore() is None  # nothing in memory: a fresh start
    _train(model, opt, snap, range(1, 4), data)
    snap.close(remove=False)  # as a killed process leaves them

    model2, opt2 = _loop(seed=1)  # other weights: the restore must overwrite them all
    data2 = {"pos": 0}
    snap2 = robust_plugins.Snapshotter(model2, opt2)
    snap2.register("data", lambda: dict(data2), data2.update)
    assert snap2.restore() == 3 and snap2.restored["source"] == "memory" and data2["pos"] == 3
    _train(model2, opt2, snap2, range(4, 6), data2)
    for a, b in zip(ref_model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(ref_opt.state.values(), opt2.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    snap2.close(remove=True)
    assert memory.job_files(memory.job_key(job)) == []


def test_a_parameter_changed_outside_the_optimizer_step_fails_the_background_snapshot(job):
    model, opt = _loop()
    snap = robust_plugins.Snapshotter(model, opt)

    def change(_step):  # on the snapshot thread, before the deferred copy: what a loop's hook might do
        with torch.no_grad():
            model[0].weight.add_(1.0)

    snap.store.before_deferred_copy = change
    _train(model, opt, snap, range(1, 2), {"pos": 0})
    with pytest.raises(CheckpointError, match="changed in place"):
        snap.settle()
    snap.close(remove=True)


def test_refusals_name_the_bad_value(job):
    model, opt = _loop()
    with pytest.raises(UnsupportedError, match="torch.optim.Optimizer"):
        robust_plugins.Snapshotter(model, object())
    with pytest.raises(ConfigError, match="memory_every is null"):
        robust_plugins.Snapshotter(model, opt, {"memory_every": None})
    with pytest.raises(ConfigError):
        robust_plugins.Snapshotter(model, opt, {"memory_evry": 1})
    snap = robust_plugins.Snapshotter(model, opt)
    snap.register("a", lambda: 1, lambda v: None)
    _train(model, opt, snap, range(1, 2), {"pos": 0})
    snap.close(remove=False)
    other = robust_plugins.Snapshotter(*_loop())
    with pytest.raises(CheckpointError, match="registered state 'a'"):
        other.restore()
    other.close(remove=True)
