"""The device helper's choices per backend and device type, checked on CPU (no GPU here).

What only a GPU can run (a CUDA stream, an NCCL communicator) is replaced by recording fakes: the
tests check which branch is taken, on which thread, in which order, with which device.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from robust_plugins import device as dev
from robust_plugins.comm import collectives, overlap
from robust_plugins.config import DEFAULT_BUCKET_MB


@pytest.mark.parametrize("backend, kind", [
    ("nccl", "cuda"), ("NCCL", "cuda"), ("gloo", "cpu"), ("mpi", "cpu"), ("cpu:gloo,cuda:nccl", "cuda"),
    ("cuda:nccl", "cuda"), ("xccl", "xpu"), ("hccl", "npu"), ("cpu:gloo", "cpu"),
])
def test_device_type_for_backend(backend, kind):
    assert dev.device_type_for_backend(backend) == kind


def test_a_group_reported_as_nccl_gets_the_ranks_cuda_device(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)  # LOCAL_RANK 3's GPU, not GPU 0
    assert dev.collective_device("g") == torch.device("cuda", 3)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert dev.collective_device("g") == torch.device("cpu")


def test_no_process_group_means_cpu():
    assert not dist.is_initialized()
    assert dev.collective_device() == torch.device("cpu")


def test_default_sizes_per_device_type(monkeypatch):
    assert dev.default_bucket_mb("cpu") == DEFAULT_BUCKET_MB == 4.0
    assert dev.default_bucket_mb("cuda") == 25.0
    assert dev.default_bucket_mb("mps") == 4.0  # unknown: CPU's
    assert collectives.piece_numel_for("cpu") == collectives.PIECE_NUMEL == 1 << 19
    assert collectives.piece_numel_for("cuda") == 1 << 22
    monkeypatch.setattr(collectives, "PIECE_NUMEL", 1 << 10)  # benchmarks and tests set the CPU size
    assert collectives.piece_numel_for("cpu") == 1 << 10 and collectives.piece_numel_for("cuda") == 1 << 22


def test_planned_bucket_size_follows_the_device_unless_set():
    from robust_plugins.patches.deepspeed_overlap import bucket_mb_for

    assert bucket_mb_for(None, "cpu") == DEFAULT_BUCKET_MB == 4.0
    assert bucket_mb_for(None, "cuda") == 25.0
    # An explicit 4 MB is the user's choice on a GPU too (not mistaken for "unset").
    assert bucket_mb_for(4.0, "cuda") == 4.0
    assert bucket_mb_for(8.0, "cuda") == 8.0 and bucket_mb_for(1.5, "cpu") == 1.5


def test_cpu_has_no_streams_or_thread_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail("set_device on CPU"))
    for d in (None, "cpu", torch.device("cpu")):
        dev.set_thread_device(d)
        assert dev.side_stream(d) is None and dev.current_stream(d) is None
        dev.synchronize(d)
    assert dev.record_event(None) is None


def test_set_thread_device_sets_the_ranks_gpu(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.append(d))
    dev.set_thread_device("cuda:1")
    assert seen == [torch.device("cuda", 1)]


# ---------------------------------------------------------------------------------------- RNG
class _FakeCudaRng:
    def __init__(self, monkeypatch, index: int):
        self.calls = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: index)
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: pytest.fail("every GPU's state saved"))
        monkeypatch.setattr(torch.cuda, "get_rng_state",
                            lambda device="cuda": self.calls.append(("get", device)) or torch.full((4,), index,
                                                                                              dtype=torch.uint8))
        monkeypatch.setattr(torch.cuda, "set_rng_state",
                            lambda state, device="cuda": self.calls.append(("set", device, state.tolist())))


def test_rng_state_saved_and_restored_for_the_current_device_only(monkeypatch):
    from robust_plugins.checkpoint.binding import rng_state as _rng_state, set_rng_state as _set_rng_state

    fake = _FakeCudaRng(monkeypatch, index=2)
    state = _rng_state()
    assert fake.calls == [("get", 2)]
    assert state["cuda"].tolist() == [2, 2, 2, 2]  # one tensor, not a list per visible GPU
    _set_rng_state(state)
    assert fake.calls[-1] == ("set", 2, [2, 2, 2, 2])
    # An older snapshot's list of every GPU's state restores this device's entry.
    dev.set_device_rng_state([torch.zeros(4, dtype=torch.uint8), torch.ones(4, dtype=torch.uint8),
                              torch.full((4,), 7, dtype=torch.uint8)])
    assert fake.calls[-1] == ("set", 2, [7, 7, 7, 7])
    with pytest.raises(ValueError, match="cover 1 device"):
        dev.set_device_rng_state([torch.zeros(4, dtype=torch.uint8)])


@pytest.mark.timeout(60)
def test_hf_trainer_binding_saves_and_restores_the_current_devices_rng_only(monkeypatch):
    # A snapshot of every visible GPU's state could not be restored with fewer GPUs visible.
    from robust_plugins.patches.transformers_trainer import _rng_states, _set_rng_states

    fake = _FakeCudaRng(monkeypatch, index=2)
    state = _rng_states()
    assert fake.calls == [("get", 2)] and state["cuda"].tolist() == [2, 2, 2, 2]
    _set_rng_states(state)
    assert fake.calls[-1] == ("set", 2, [2, 2, 2, 2])


def test_rng_state_on_cpu_has_no_cuda_entry():
    from robust_plugins.checkpoint.binding import rng_state as _rng_state

    assert dev.device_rng_state() is None and "cuda" not in _rng_state()
    dev.set_device_rng_state(None)  # nothing saved: nothing to do


# ------------------------------------------------------------------------- the overlap thread
class _Log:
    """Fakes of the device helpers overlap.py calls, recording (thread name, call)."""

    def __init__(self, monkeypatch):
        self.calls: list = []
        log = self

        class Stream:
            device = torch.device("cuda", 1)

            def __init__(self, name):
                self.name = name

            def wait_event(self, event):
                log.add("wait_event", self.name, event)

        class Event:
            def __init__(self, where):
                self.where = where

            def __repr__(self):
                return f"event@{self.where}"

        self.main = Stream("main")
        self.side = Stream("side")

        def current_stream(device):
            log.add("current_stream", device)
            return self.main if device is not None else None

        def side_stream(device):
            log.add("side_stream", device)
            return self.side

        def record_event(stream):
            log.add("record_event", None if stream is None else stream.name)
            return None if stream is None else Event(stream.name)

        monkeypatch.setattr(overlap, "set_thread_device", lambda d: log.add("set_thread_device", d))
        monkeypatch.setattr(overlap, "side_stream", side_stream)
        monkeypatch.setattr(overlap, "current_stream", current_stream)
        monkeypatch.setattr(overlap, "record_event", record_event)
        monkeypatch.setattr(overlap, "_on", lambda stream: _Ctx(log, stream))

    def add(self, *call):
        self.calls.append((threading.current_thread().name, *[str(c) for c in call]))


class _Ctx:
    def __init__(self, log, stream):
        self.log, self.stream = log, stream

    def __enter__(self):
        self.log.add("enter", self.stream.name)

    def __exit__(self, *exc):
        self.log.add("exit", self.stream.name)


class _Tensor:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def record_stream(self, stream):
        self.log.add("record_stream", self.name, stream.name)


@pytest.mark.timeout(60)
def test_sync_thread_on_a_gpu_runs_inline_on_a_side_stream_ordered_by_events(monkeypatch):
    # CUDA: no thread; the training thread launches the reduction onto its side stream (NCCL
    # launches are asynchronous), so one host thread drives every communicator.
    log = _Log(monkeypatch)
    cuda1 = torch.device("cuda", 1)
    started = threading.active_count()
    thread = overlap.SyncThread("fake-gpu-sync", "test bucket", device=cuda1)
    assert thread.inline and threading.active_count() == started  # nothing started
    handle = thread.submit("b0", lambda: log.add("work"), [_Tensor(log, "g0"), _Tensor(log, "g1")])
    assert handle.is_completed()  # launched at submit; the device orders the rest
    handle.wait(10)
    thread.close()
    main = threading.current_thread().name
    assert {c[0] for c in log.calls} == {main}
    assert log.calls == [
        (main, "side_stream", "cuda:1"),                                         # at construction
        (main, "current_stream", "cuda:1"), (main, "record_event", "main"),    # at submit
        (main, "enter", "side"),
        (main, "wait_event", "side", "event@main"),   # after the caller's kernels
        (main, "work"),
        (main, "record_stream", "g0", "side"), (main, "record_stream", "g1", "side"),
        (main, "record_event", "side"),
        (main, "exit", "side"),
        (main, "current_stream", "cuda:1"), (main, "wait_event", "main", "event@side"),  # at wait
    ]
    assert overlap.runs_inline(cuda1) and not overlap.runs_inline(torch.device("cpu"))
    assert not overlap.runs_inline(None)


def test_sync_thread_on_cpu_has_no_stream_work(monkeypatch):
    # The real helpers: CPU gives no stream and no events, and the work runs as it is.
    ran = []
    thread = overlap.SyncThread("cpu-sync", "test bucket", device=torch.device("cpu"))
    try:
        h = thread.submit("b0", lambda: ran.append(threading.current_thread().name), [torch.zeros(2)])
        h.wait(10)
    finally:
        thread.close()
    assert ran == ["cpu-sync"] and h._finished is None


def test_eager_communicator_init_only_for_lazy_backends():
    assert overlap.needs_eager_init("nccl") and overlap.needs_eager_init("cpu:gloo,cuda:nccl")
    assert not overlap.needs_eager_init("gloo")


class _FakeDist:
    """Enough of torch.distributed for clone_groups on rank 1 of 3, groups {0,1} and {1,2} (+ {0,2})."""

    def __init__(self, monkeypatch, backend):
        self.calls = []
        mine = {"A": (0, 1), "B": (1, 2)}
        monkeypatch.setattr(dist, "get_process_group_ranks", lambda g: list(mine[g] if g in mine else g))
        monkeypatch.setattr(dist, "get_backend", lambda g=None: backend)
        monkeypatch.setattr(dist, "get_world_size", lambda g=None: 3)

        def all_gather_object(out, obj):
            out[:] = [[((0, 2), backend), ((0, 1), backend)], obj, [((1, 2), backend), ((0, 2), backend)]]

        monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
        monkeypatch.setattr(dist, "new_group", lambda ranks, backend: self.calls.append(("new", tuple(ranks)))
                            or tuple(ranks))
        monkeypatch.setattr(dist, "all_reduce", lambda t, group: self.calls.append(("init", group, t.device.type)))


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
@pytest.mark.timeout(60)
def test_clone_groups_clones_gloo_groups_in_one_order_and_never_nccl_ones(monkeypatch, backend):
    fake = _FakeDist(monkeypatch, backend)
    clones = overlap.clone_groups(["B", "A"])
    if backend == "nccl":
        # The inline sync runs on the training thread, which drives the host's groups already.
        assert clones == {id("A"): "A", id("B"): "B"} and fake.calls == []
        return
    assert clones == {id("A"): (0, 1), id("B"): (1, 2)}
    # The union, sorted, on every rank (gloo connects inside new_group: nothing left to initialise).
    assert fake.calls == [("new", (0, 1)), ("new", (0, 2)), ("new", (1, 2))]


def test_one_bit_adam_reads_host_step_counts_without_a_device_copy(monkeypatch):
    from robust_plugins.comm import momentum

    monkeypatch.setattr(torch, "stack", lambda *a, **k: pytest.fail("host steps were stacked for a copy"))
    steps = [torch.tensor(3.0), torch.tensor(7.0, dtype=torch.float32), 2]
    assert momentum._as_floats(steps) == [3.0, 7.0, 2.0]


def test_the_hand_back_trial_times_a_bounded_piece_of_the_gradient(monkeypatch):
    from robust_plugins.patches import deepspeed_overlap as dso

    grads = [torch.arange(5.0), torch.arange(7.0) + 10]
    whole = dso.trial_tensor(grads, lambda gs: torch.cat([g.reshape(-1) for g in gs]))
    assert whole.tolist() == grads[0].tolist() + grads[1].tolist()  # small: the whole gradient, as before
    monkeypatch.setattr(dso, "HOST_TRIAL_NUMEL", 8)
    part = dso.trial_tensor(grads, lambda gs: pytest.fail("flattened the whole gradient"))
    assert part.tolist() == grads[0].tolist() + [10.0, 11.0, 12.0]


def test_threads_started_by_the_package_take_the_callers_device(monkeypatch):
    assert dev.thread_device() is None  # no CUDA here: nothing to hand over
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    assert dev.thread_device() == torch.device("cuda", 5)
