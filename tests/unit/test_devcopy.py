"""GPU snapshots on CPU: which tensors take the asynchronous path, and the order of its steps.

A recording copier stands in for the CUDA one (no GPU here): the test checks that ``save`` queues
its own copies and then fences the caller's stream, and that the snapshot thread sets the device,
copies the deferred tensors and waits for every copy before the crc32 and the commit flag.
"""

from __future__ import annotations

import threading
import uuid

import pytest
import torch

from robust_plugins.checkpoint import devcopy, memory


@pytest.fixture
def job():
    key = f"t18a{uuid.uuid4().hex[:8]}"
    yield key
    memory.remove_job(key)


def test_only_cuda_tensors_take_the_asynchronous_path():
    assert devcopy.snapshot_device([torch.zeros(2), torch.ones(1, dtype=torch.int8)]) is None
    assert devcopy.snapshot_device([torch.empty(2, device="meta")]) is None
    assert devcopy.for_tensors([torch.zeros(3)], slot=None) is None
    dst = torch.zeros(3)
    devcopy.copy_into(dst, torch.arange(3.0), None)
    assert dst.tolist() == [0.0, 1.0, 2.0]


class _Recorder:
    def __init__(self, slots_committed):
        self.calls = []
        self._committed = slots_committed

    def _add(self, *what):
        self.calls.append((threading.current_thread().name.startswith("robust-snapshot"), *what))

    def copy(self, dst, src):
        dst.copy_(src)  # the real copier's result, synchronously
        self._add("copy", int(src.numel()))

    def fence_inline(self):
        self._add("fence_inline")

    def on_thread(self):
        self._add("on_thread")

    def finish(self):
        self._add("finish", self._committed())


def test_snapshot_of_device_state_fences_copies_before_the_commit(job, monkeypatch):
    st = memory.SnapshotStore(job, 0, 1)
    rec = _Recorder(lambda: [s.header().committed for s in st.slots if s.header() is not None])
    monkeypatch.setattr(devcopy, "for_tensors", lambda tensors, slot: rec)
    monkeypatch.setattr(devcopy, "copy_into", lambda dst, src, copier: copier.copy(dst, src))
    params, residual = torch.arange(6.0), torch.full((4,), 2.0)
    try:
        st.save(1, {"p": params, "r": residual}, defer={params.data_ptr()})
        st.settle(30)
        assert rec.calls == [
            (False, "copy", 4),           # the residual, inside save, on the training thread
            (False, "fence_inline"),      # then the caller's stream waits for it
            (True, "on_thread"),          # the snapshot thread: device first
            (True, "copy", 6),            # the deferred parameters
            (True, "finish", [False]),    # every copy landed while still uncommitted
        ]
        step, back = st.load(st.own_snapshots()[0].slot)
        assert step == 1 and back["p"].tolist() == params.tolist() and back["r"].tolist() == residual.tolist()
    finally:
        st.close(remove=True)
