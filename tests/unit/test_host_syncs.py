"""Per-step and per-window host syncs kept off the training path (issue 37): ZeRO-3's telemetry
windows read no device clock that is still running; megatron's step_end issues no collective and
no ``.item()`` between ``log_every`` steps; the flight recorder's variables name every torch in
the declared range."""

from __future__ import annotations

import collections

import pytest

import robust_plugins.comm as comm
from robust_plugins.patches.deepspeed_telemetry import Zero3Collectives


class _DeviceCounter:
    """A WireCounter whose collective runs on a device until the test says it finished: reading
    ``seconds`` before then is a host sync (counted)."""

    made: list["_DeviceCounter"] = []
    waits = 0

    def __init__(self, *args, **kwargs):
        self.by_op = collections.Counter({"all_gather_into_tensor": 100})
        self.done = False
        _DeviceCounter.made.append(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    @property
    def seconds(self):
        if not self.done:
            _DeviceCounter.waits += 1
        return 1.0

    def settled_seconds(self):
        return 1.0 if self.done else 0.0

    def unsettled(self):
        return 0 if self.done else 1


def test_zero3_windows_wait_for_no_running_collective(monkeypatch):
    monkeypatch.setattr(comm, "WireCounter", _DeviceCounter)
    monkeypatch.setattr(_DeviceCounter, "made", [])
    monkeypatch.setattr(_DeviceCounter, "waits", 0)
    z = Zero3Collectives()
    for _ in range(3):  # three forwards whose all-gathers still run when each returns
        with z.window("forward"):
            pass
    assert _DeviceCounter.waits == 0
    _DeviceCounter.made[0].done = _DeviceCounter.made[1].done = True
    with z.window("backward"):
        pass
    assert _DeviceCounter.waits == 0
    out = z.take()  # the record (rank 0, every log_every steps): waits for what still runs
    assert _DeviceCounter.waits == 2  # the third forward and the backward
    assert out == {"forward_all_gather_bytes": 300, "forward_reduce_scatter_bytes": 0, "forward_comm_s": 3.0,
                   "backward_all_gather_bytes": 100, "backward_reduce_scatter_bytes": 0, "backward_comm_s": 1.0}
    assert z.take() == {}
    # A rank that never records (not rank 0) keeps a bounded number of windows open.
    monkeypatch.setattr(Zero3Collectives, "MAX_OPEN", 4)
    for _ in range(10):
        with z.window("forward"):
            pass
    assert len(z._open) <= 4


def test_megatron_agrees_on_sigterm_at_agreed_steps_only(monkeypatch):
    import types

    import torch
    import torch.distributed as dist

    import robust_plugins.megatron as rpm

    clock = [100.0]
    monkeypatch.setattr(rpm.time, "monotonic", lambda: clock[0])
    peer = {"term": 0, "steps": 1000}  # what the other rank proposes
    reduced = []

    def all_reduce(t, op=None):  # two ranks, MAX: the smallest proposal wins
        reduced.append(clock[0])
        t.copy_(torch.maximum(t, torch.tensor([peer["term"], -peer["steps"]], dtype=t.dtype)))

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(rpm, "collective_device", lambda group=None: torch.device("cpu"))
    ckpt = types.SimpleNamespace(_term=False, _next_term_check=None, _last_term_check=None)
    agreed = []
    for step in range(1, 41):  # 50 ms steps: 20 fit in TERM_CHECK_S
        clock[0] += 0.05
        if step == 15:
            ckpt._term = True  # SIGTERM arrives at this rank
        if rpm.MegatronCheckpointer._term_agreed(ckpt, step):
            agreed.append(step)
            ckpt._term = False
    assert rpm.term_check_interval(0.05) == 20 and rpm.term_check_interval(None) == 1
    assert rpm.term_check_interval(2.0) == 1 and rpm.term_check_interval(1e-5) == rpm.TERM_CHECK_MAX_STEPS
    # Step 1 (pace unknown), 2 (pace known: every 20 steps), 22: 3 collectives in 40 steps.
    assert len(reduced) == 3 and agreed == [22]
    # A slower peer's smaller proposal wins, on every rank alike.
    peer["steps"] = 3
    assert not rpm.MegatronCheckpointer._term_agreed(ckpt, 42)
    assert ckpt._next_term_check == 45
    peer["term"] = 1  # the peer was signalled: this rank learns it at the agreed step
    assert not rpm.MegatronCheckpointer._term_agreed(ckpt, 44)
    assert rpm.MegatronCheckpointer._term_agreed(ckpt, 45)


def test_host_copies_of_optimizer_state_go_in_batches():
    import torch

    from robust_plugins.patches.megatron_optim import copy_to_host, host_batches

    f32 = [torch.randn(n) for n in (10, 20, 30)]
    bf = [torch.randn(5).bfloat16()]
    tensors = [f32[0], f32[1], bf[0], f32[2]]
    # One batch per run of one dtype and device within the byte bound; a tensor over it alone.
    assert host_batches(tensors, 1 << 20) == [[0, 1], [2], [3]]
    assert host_batches(f32, 100) == [[0], [1], [2]]  # 40 + 80 > 100
    assert host_batches(f32, 120) == [[0, 1], [2]]
    big = [torch.randn(4, 8), torch.randn(3)]
    out = copy_to_host(big)
    assert [t.shape for t in out] == [(4, 8), (3,)] and all(torch.equal(a, b) for a, b in zip(out, big))
    assert out[0].data_ptr() != big[0].data_ptr()  # copies, not the live state


def test_distributed_optimizer_state_is_staged_on_host_for_a_save():
    import types

    import torch
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from robust_plugins.patches import megatron_optim

    model = [torch.nn.Parameter(torch.randn(6)), torch.nn.Parameter(torch.randn(2, 3))]
    main = [p.detach().clone().requires_grad_() for p in model]
    inner = torch.optim.AdamW(main, lr=0.1)
    for p in main:
        p.grad = torch.ones_like(p)
    inner.step()
    opt = object.__new__(DistributedOptimizer)  # megatron's own getter, on a hand-built instance
    opt.optimizer = inner
    opt.config = types.SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False)
    opt.model_param_group_index_map = {model[0]: (0, 0), model[1]: (0, 1)}
    live = {p: opt._get_main_param_and_optimizer_states(p) for p in model}
    with megatron_optim.states_on_host(opt):
        staged = {p: opt._get_main_param_and_optimizer_states(p) for p in model}
    for p in model:
        assert set(staged[p]) == set(live[p]) and staged[p]["step"] is live[p]["step"]
        for key in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(staged[p][key], live[p][key])
            assert staged[p][key].data_ptr() != live[p][key].data_ptr()  # from the batched copy
    assert "_get_main_param_and_optimizer_states" not in vars(opt)  # unbound after the save
