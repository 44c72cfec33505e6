"""In-memory snapshot core: flat serializer, shared-memory slots, peer and restore planners."""

from __future__ import annotations

import enum
import json
import os
import random
import struct
import uuid

import numpy as np
import pytest
import torch

from robust_plugins.checkpoint import flat, memory, slot
from robust_plugins.checkpoint.peer import plan_peers
from robust_plugins.checkpoint.restore import MEMORY, PEER, plan_restore
from robust_plugins.errors import CheckpointError


class Color(enum.Enum):
    RED = 1


class Scaler:
    def __init__(self):
        self.cur_scale, self.history = 2.0**16, [1, 2]


def _state():
    return {
        "w": torch.randn(7, 3), 5: [torch.arange(4, dtype=torch.int64), (1, 2.5, float("nan"), float("-inf"))],
        "bf16": torch.ones(3, dtype=torch.bfloat16), "empty": torch.zeros(0), "flag": torch.tensor([True, False]),
        "np": np.random.RandomState(3).get_state(), "py": random.Random(4).getstate(), "dtype": torch.float16,
        "enum": Color.RED, "obj": Scaler(), "none": None, "s": "x",
    }


def test_flat_round_trip_keeps_types_values_and_int_keys():
    state = _state()
    allowed = flat.allow(Color, Scaler)
    schema, tensors = flat.flatten(state, allowed)
    back = flat.unflatten(schema, [t.clone() for t in tensors], allowed)
    assert torch.equal(back["w"], state["w"]) and back["bf16"].dtype == torch.bfloat16
    assert back[5][1][:2] == (1, 2.5) and np.isnan(back[5][1][2]) and back[5][1][3] == float("-inf")
    assert back["np"][0] == "MT19937" and back["np"][1].dtype == np.uint32
    assert np.array_equal(back["np"][1], state["np"][1])
    r = random.Random()
    r.setstate(back["py"])
    assert r.random() == random.Random(4).random()
    assert back["enum"] is Color.RED and isinstance(back["obj"], Scaler) and back["obj"].history == [1, 2]
    assert back["dtype"] == torch.float16 and back["none"] is None and back["s"] == "x"


def test_flat_refuses_unknown_objects_both_ways_naming_the_path():
    with pytest.raises(CheckpointError, match=r"state\['obj'\].*Scaler.*allowlisted"):
        flat.flatten({"obj": Scaler()})
    schema, tensors = flat.flatten({"obj": Scaler()}, flat.allow(Scaler))
    with pytest.raises(CheckpointError, match=r"does not allow.*not loaded"):
        flat.unflatten(schema, tensors, {})
    schema["tensors"].append(["os.system", [1]])
    with pytest.raises(CheckpointError, match="not a torch dtype"):
        flat.tensor_specs(schema)


@pytest.fixture
def job():
    key = "t" + uuid.uuid4().hex[:12]
    yield key
    memory.remove_job(key)


def test_store_round_trip_double_buffer_and_survival_in_a_new_store(job):
    st = memory.SnapshotStore(job, 0, 2, allowed=flat.allow(Color, Scaler))
    state = _state()
    st.save(1, state)
    state["w"].add_(1)
    st.save(2, state)
    st.flush()
    st.close()  # like a process that died: files stay
    fresh = memory.SnapshotStore(job, 0, 2, allowed=flat.allow(Color, Scaler))
    snaps = fresh.own_snapshots()
    assert [s.step for s in snaps] == [2, 1] and {s.slot for s in snaps} == {0, 1}
    step, back = fresh.load(snaps[0].slot)
    assert step == 2 and torch.equal(back["w"], state["w"])
    back["w"].zero_()  # a clone, not a view of shared memory
    assert fresh.load(snaps[0].slot)[1]["w"].abs().sum() > 0
    # the next save overwrites the older slot (step 1) and keeps step 2 restorable
    fresh.save(3, state)
    fresh.flush()
    assert [s.step for s in fresh.own_snapshots()] == [3, 2]
    fresh.close(remove=True)
    assert memory.job_files(job) == []


def test_a_copy_interrupted_before_commit_leaves_the_other_slot(job):
    st = memory.SnapshotStore(job, 0, 1)
    st.save(1, {"w": torch.ones(1000)})
    st.save(2, {"w": torch.ones(1000) * 2})
    st.flush()
    # What a SIGKILL mid-copy leaves: the slot being written has committed = 0.
    newest = max(st.slots, key=lambda s: s.header().step)
    newest.set_committed(False)
    why = {}
    assert [s.step for s in st.own_snapshots(why)] == [1]
    assert why == {newest.path: "step 2 was never committed (the process died while writing it)"}
    st.close()


def test_corruption_and_mismatches_are_named(job):
    st = memory.SnapshotStore(job, 1, 4)
    st.save(9, {"w": torch.ones(100)})
    st.flush()
    slot = st.slots[0]
    assert slot.problem(job, 4, 1) is None
    assert "world size 4, this job has 8" in slot.problem(job, 8, 1)
    assert "rank 1's state, not rank 0's" in slot.problem(job, 4, 0)
    assert "belongs to job" in slot.problem("other", 4, 1)
    h = slot.header()
    slot.buf[h.data_off + 3] ^= 0x01
    assert "crc32" in slot.problem(job, 4, 1) and "corrupted" in slot.problem(job, 4, 1)
    st.close()


def test_changing_layout_regrows_the_slot(job):
    st = memory.SnapshotStore(job, 0, 1)
    st.save(1, {"w": torch.ones(10)})
    st.save(2, {"w": torch.ones(10)})
    st.save(3, {"w": torch.arange(100_000, dtype=torch.float32), "extra": {"k": list(range(5000))}})
    st.flush()
    step, back = st.load(st.own_snapshots()[0].slot)
    assert step == 3 and torch.equal(back["w"], torch.arange(100_000, dtype=torch.float32))
    assert back["extra"]["k"] == list(range(5000))
    st.close()


def test_job_key_needs_a_stable_id():
    assert memory.job_key(env={"ROBUST_JOB_ID": "a"}) == memory.job_key(env={"ROBUST_JOB_ID": "a"})
    assert memory.job_key(env={"ROBUST_JOB_ID": "a"}) != memory.job_key(env={"TORCHELASTIC_RUN_ID": "b"})
    with pytest.raises(CheckpointError, match="ROBUST_JOB_ID"):
        memory.job_key(env={"TORCHELASTIC_RUN_ID": "none"})


def test_full_shm_is_a_clear_error(tmp_path, monkeypatch):
    def enospc(fd, off, size):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", enospc)
    st = memory.SnapshotStore("tfull", 0, 1, root=str(tmp_path))
    with pytest.raises(CheckpointError, match=r"Cannot reserve .* /dev/shm is full.*memory_every"):
        st.save(1, {"w": torch.ones(10)})
    st.close()


@pytest.mark.parametrize("nodes, per_node", [(2, 4), (4, 8), (3, 2), (128, 8)])
def test_peers_are_on_another_node_and_form_a_permutation(nodes, per_node):
    hosts = [f"n{r // per_node}" for r in range(nodes * per_node)]
    holder = plan_peers(hosts)
    assert sorted(holder) == list(range(len(hosts)))
    assert all(hosts[r] != hosts[holder[r]] for r in range(len(hosts)))


def test_peers_leave_the_model_parallel_group_when_the_layout_allows():
    # 2 nodes x 4 ranks; TP groups of 2 inside a node; PP pairs across nodes (r, r+4).
    hosts = [f"n{r // 4}" for r in range(8)]
    tp = [[0, 1], [2, 3], [4, 5], [6, 7]]
    pp = [[0, 4], [1, 5], [2, 6], [3, 7]]
    holder = plan_peers(hosts, tp + pp)
    for r in range(8):
        assert hosts[holder[r]] != hosts[r]
        assert not any(r in g and holder[r] in g for g in tp + pp)
    with pytest.raises(CheckpointError, match="at least 2 ranks"):
        plan_peers(["n0"])
    # one node: the copy is on another rank (the best that layout allows)
    assert all(h != r for r, h in enumerate(plan_peers(["n0"] * 4)))


def test_restore_plan_prefers_own_then_peer_and_needs_a_common_step():
    reports = [{"own": [[8, 0], [7, 1]], "held": {"1": [[8, 1], [7, 0]]}},
               {"own": [], "held": {"0": [[8, 0]]}}]
    plan = plan_restore(reports)
    assert plan.step == 8 and plan.sources == ((MEMORY, 0, 0), (PEER, 0, 1))
    # rank 1 died before committing 8: everyone goes back to 7
    reports = [{"own": [[8, 0], [7, 1]], "held": {}}, {"own": [[7, 0], [6, 1]], "held": {}}]
    assert plan_restore(reports).step == 7 and plan_restore(reports).sources[0] == (MEMORY, 0, 1)
    none = plan_restore([{"own": [[8, 0]]}, {"own": []}])
    assert none.step is None and "ranks [1] have no snapshot" in none.reason
    apart = plan_restore([{"own": [[8, 0]]}, {"own": [[6, 0]]}])
    assert apart.step is None and "no step is held for every rank" in apart.reason
    stale = plan_restore([{"own": [[8, 0]]}, {"own": [[8, 0]]}], disk_step=10)
    assert stale.step is None and "older than the disk checkpoint of step 10" in stale.reason


def test_header_layout_is_fixed():
    assert slot._FIELDS.size == 60 and slot.HEADER_SIZE == 4096
    buf = bytearray(slot.HEADER_SIZE)
    slot._FIELDS.pack_into(buf, 0, slot.MAGIC, 1, slot.FORMAT, 5, 2, 4, 10, 8192, 64, 123)
    h = slot.read_header(buf)
    assert (h.committed, h.step, h.rank, h.world_size, h.total, h.crc) == (True, 5, 2, 4, 8256, 123)
    assert struct.unpack_from("<I", buf, slot._COMMITTED_OFF)[0] == 1


def test_after_a_rollback_memory_newer_than_the_bad_step_is_not_used(tmp_path):
    from robust_plugins.checkpoint.restore import rollback_bound

    faults = [{"kind": "crash", "step": 30, "action": "restart", "incarnation": 0},
              {"kind": "nan", "step": 25, "action": "rollback", "incarnation": 1},
              {"kind": "sdc", "step": 40, "action": "rollback", "incarnation": 2, "detail": {"check_every": 5}}]
    (tmp_path / "faults.jsonl").write_text("".join(json.dumps(f) + "\n" for f in faults))
    env = {"ROBUST_RUN_DIR": str(tmp_path)}
    assert rollback_bound({**env, "ROBUST_INCARNATION": "1"}) is None  # a crash: no limit
    assert rollback_bound({**env, "ROBUST_INCARNATION": "2"}) == 24
    assert rollback_bound({**env, "ROBUST_INCARNATION": "3"}) == 35
    assert rollback_bound({}) is None
    assert rollback_bound({**env, "ROBUST_INCARNATION": "1", "ROBUST_ROLLBACK_MAX_STEP": "17"}) == 17
    assert rollback_bound({**env, "ROBUST_INCARNATION": "1", "ROBUST_ROLLBACK_MAX_STEP": ""}) is None
    reports = [{"own": [[25, 0], [24, 1]]}, {"own": [[25, 1], [24, 0]]}]
    assert plan_restore(reports, max_step=24).step == 24
    late = plan_restore(reports, max_step=20)
    assert late.step is None and "rolls back to step 20" in late.reason


def test_bench_checkpoint_table_reports_ratios_from_medians():
    from robust_plugins.cli.bench.checkpoint import table

    r = {"world_size": 4, "preset": "small", "params": 880_000, "steps": 3, "step_s": [0.2, 0.1, 0.3],
         "blocking_s": [0.002, 0.004, 0.003], "snapshot_bytes": 6_000_000, "ds_save_s": [0.02, 0.03, 0.04],
         "verified_save_s": [0.06, 0.05, 0.04], "ds_bytes": 14_000_000, "verified_bytes": 14_010_000,
         "restore_memory_s": [0.01, 0.02, 0.03], "restore_disk_s": [0.05, 0.04, 0.06]}
    text = table(r, "robust bench checkpoint --nproc 4")
    assert "| snapshot blocking (median) | 3.00 ms | 1.5% of a step |" in text
    assert "1.67x DeepSpeed's time" in text and "0.100x (10x less blocking)" in text
    assert "memory is 2.5x faster" in text and "Command: `robust bench checkpoint --nproc 4`" in text


def test_a_slow_peer_send_or_disk_save_does_not_delay_the_next_commit(job):
    import threading
    import time

    release = threading.Event()

    def after_commit(_index, slot):
        if slot.header().step == 1:
            release.wait(10)  # a slow background disk save of step 1

    st = memory.SnapshotStore(job, 0, 1, after_commit=after_commit)
    st.save(1, {"w": torch.ones(10)})
    st.save(2, {"w": torch.ones(10) * 2})
    deadline = time.monotonic() + 5
    while st.committed_step != 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert st.committed_step == 2  # committed while step 1's hand-off still runs
    assert [s.step for s in st.own_snapshots()] == [2, 1]
    assert st.slots[0].busy.is_set()  # step 3 would wait for slot 0 (step 1's) to be free
    release.set()
    st.flush()
    st.close()


def test_client_state_that_cannot_be_snapshotted_is_refused_before_any_save():
    """save_checkpoint(client_state=...) with memory snapshots: an object that is neither a tensor
    nor plain data is refused, naming its path, before anything is written."""
    pytest.importorskip("deepspeed")
    from types import SimpleNamespace

    from robust_plugins.patches.deepspeed_memory import MemorySnapshots

    mem = MemorySnapshots.__new__(MemorySnapshots)  # only note_client_state's inputs are needed
    mem.engine, mem.taken_at, mem.client_state = SimpleNamespace(global_steps=3), None, None

    class Sampler:
        pass

    with pytest.raises(CheckpointError, match=r"client_state.*state\['sampler'\].*Sampler.*nothing was saved"):
        mem.note_client_state({"epoch": 1, "sampler": Sampler()})
    assert mem.client_state is None
    given = {"epoch": 1, "pos": torch.arange(3)}
    mem.note_client_state(given)
    given["pos"].add_(10)  # the caller changes its tensor after the call: the copy does not move
    assert mem.client_state["step"] == 3 and mem.client_state["state"]["pos"].tolist() == [0, 1, 2]


def test_replace_newest_rewrites_the_newest_slot_and_keeps_the_older(tmp_path):
    """A second snapshot of one step (save_checkpoint's client_state) goes into the newest slot:
    the older slot keeps the previous step, and the next step overwrites that older slot."""
    st = memory.SnapshotStore("replace", 0, 1, root=str(tmp_path))
    try:
        st.save(1, {"x": torch.ones(3)})
        st.save(2, {"x": torch.full((3,), 2.0)})
        st.flush()
        st.save(2, {"x": torch.full((3,), 5.0), "cs": "given"}, replace_newest=True)
        st.flush()
        snaps = {s.step: s.slot for s in st.own_snapshots()}
        assert sorted(snaps) == [1, 2]
        state = st.load(snaps[2])[1]
        assert state["cs"] == "given" and state["x"].tolist() == [5.0, 5.0, 5.0]
        assert st.load(snaps[1])[1]["x"].tolist() == [1.0, 1.0, 1.0]
        st.save(3, {"x": torch.full((3,), 3.0)})
        st.flush()
        assert sorted(s.step for s in st.own_snapshots()) == [2, 3]
    finally:
        st.close(remove=True)


def _steps(st) -> list[int]:
    st.flush()
    return sorted(s.step for s in st.own_snapshots())


def test_three_slots_never_overwrite_the_kept_step(tmp_path):
    """With a peer backup the step every peer copy holds (keep_step) stays while newer snapshots
    rotate through the other two slots; a newer agreed step releases the old one."""
    st = memory.SnapshotStore("keep", 0, 1, root=str(tmp_path), n_slots=3)
    try:
        for step in (1, 2, 3):
            st.save(step, {"x": torch.full((3,), float(step))})
        assert _steps(st) == [1, 2, 3]
        st.keep_step = 1  # the copies of 2 and 3 still in flight
        st.save(4, {"x": torch.full((3,), 4.0)})
        assert _steps(st) == [1, 3, 4]
        st.save(5, {"x": torch.full((3,), 5.0)})
        assert _steps(st) == [1, 4, 5]
        st.keep_step = 4
        st.save(6, {"x": torch.full((3,), 6.0)})
        assert _steps(st) == [4, 5, 6]
        with pytest.raises(ValueError, match="at least 2 slots"):
            memory.SnapshotStore("keep", 0, 1, root=str(tmp_path), n_slots=1)
    finally:
        st.close(remove=True)


def test_replacing_the_kept_step_goes_to_another_slot_and_retires_the_first(tmp_path):
    """save_checkpoint's second snapshot of a step whose copies are agreed: the kept slot is not
    rewritten in place (a crash mid-write would lose the agreed step); the new one, once
    committed, is the only snapshot of that step."""
    st = memory.SnapshotStore("keep2", 0, 1, root=str(tmp_path), n_slots=3)
    try:
        for step in (1, 2, 3):
            st.save(step, {"x": torch.full((3,), float(step))})
        st.flush()
        kept = {s.step: s.slot for s in st.own_snapshots()}[3]
        st.keep_step = 3
        st.save(3, {"x": torch.full((3,), 7.0), "cs": "given"}, replace_newest=True)
        assert _steps(st) == [2, 3]
        (new,) = [s for s in st.own_snapshots() if s.step == 3]
        assert new.slot != kept and st.load(new.slot)[1]["cs"] == "given"
    finally:
        st.close(remove=True)


def test_a_leftover_snapshot_of_the_same_step_is_retired(tmp_path):
    """A restarted incarnation that snapshots a step an earlier one had snapshotted too (after a
    rollback) leaves only its own: a restore must never pick the old one."""
    old = memory.SnapshotStore("again", 0, 1, root=str(tmp_path))
    old.save(4, {"x": torch.full((3,), 4.0)})
    old.save(5, {"x": torch.full((3,), 5.0)})
    old.flush()
    old.close()
    st = memory.SnapshotStore("again", 0, 1, root=str(tmp_path))
    try:
        st.save(5, {"x": torch.full((3,), -5.0)})
        assert _steps(st) == [5]
        (snap,) = st.own_snapshots()
        assert st.load(snap.slot)[1]["x"].tolist() == [-5.0] * 3
    finally:
        st.close(remove=True)


# -------------------------------------------------------- background copy (memory_copy: background)
def _gate(step_to_hold: int):
    """A before_deferred_copy hook that holds the copy of one step until released."""
    import threading

    release, reached = threading.Event(), threading.Event()

    def hook(step):
        if step == step_to_hold:
            reached.set()
            assert release.wait(30), "test gate never released"

    return hook, release, reached


def test_deferred_tensors_are_copied_on_the_snapshot_thread_and_committed_only_after(tmp_path):
    """Stable tensors are copied after save() returns; the others at the save. The slot is
    committed (restorable) only once the background copy is done."""
    st = memory.SnapshotStore("defer", 0, 1, root=str(tmp_path))
    try:
        w, r = torch.arange(1000, dtype=torch.float32), torch.ones(10)
        st.save(1, {"w": w, "r": r}, defer={w.data_ptr()})
        st.settle()
        hook, release, reached = _gate(2)
        st.before_deferred_copy = hook
        w2, r2 = w * 2, r * 2
        st.save(2, {"w": w2, "r": r2}, defer={w2.data_ptr()})
        assert reached.wait(10)
        # in flight: step 2 is not committed, step 1 is what a restore would see
        assert [s.step for s in st.own_snapshots()] == [1]
        r2.add_(100)  # not deferred: copied at the save, a later change does not reach the snapshot
        release.set()
        st.settle()
        snaps = st.own_snapshots()
        assert [s.step for s in snaps] == [2, 1]
        back = st.load(snaps[0].slot)[1]
        assert torch.equal(back["w"], w * 2) and torch.equal(back["r"], torch.full((10,), 2.0))
    finally:
        st.close(remove=True)


def test_the_optimizer_step_waits_for_the_background_copy(tmp_path):
    """The contract the bindings keep: a step pre-hook settles the store, so the optimizer step
    cannot change parameters or moments while their copy is in flight; the snapshot holds
    exactly the state before the step."""
    import threading

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    st = memory.SnapshotStore("stepwait", 0, 1, root=str(tmp_path))

    def wait_for_snapshot(*_):
        st.settle()  # as MegatronMemory's hook (a step pre-hook returns None)

    opt.register_step_pre_hook(wait_for_snapshot)

    def train_step():
        model(torch.randn(8, 64)).square().sum().backward()
        opt.step()

    try:
        train_step()
        state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        stable = {p.data_ptr() for p in model.parameters()}
        stable |= {t.data_ptr() for s in opt.state.values() for t in s.values()}
        before = {k: v.clone() for k, v in state["model"].items()}
        moments = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
        hook, release, reached = _gate(1)
        st.before_deferred_copy = hook
        st.save(1, state, defer=stable)
        assert reached.wait(10)
        stepper = threading.Thread(target=train_step)
        stepper.start()
        stepper.join(0.5)
        assert stepper.is_alive()  # held in the pre-hook: the copy is still in flight
        assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
        release.set()
        stepper.join(30)
        assert not stepper.is_alive()
        back = st.load(st.own_snapshots()[0].slot)[1]
        assert all(torch.equal(back["model"][k], v) for k, v in before.items())
        assert not torch.equal(model.weight, before["weight"])  # the step ran, after the copy
        saved_moments = [back["optimizer"]["state"][i]["exp_avg"] for i in range(2)]
        assert all(torch.equal(a, b) for a, b in zip(saved_moments, moments))
    finally:
        st.close(remove=True)


def test_a_tensor_changed_in_place_during_the_copy_fails_the_snapshot(tmp_path):
    """A deferred tensor changed outside the optimizer step while its copy is in flight: the
    snapshot is not committed, the previous one stays the restore point, and the error names
    the tensor and the way out."""
    st = memory.SnapshotStore("torn", 0, 1, root=str(tmp_path))
    try:
        w = torch.zeros(100)
        st.save(1, {"model": {"w": w}}, defer={w.data_ptr()})
        st.settle()
        hook, release, reached = _gate(2)
        st.before_deferred_copy = hook
        st.save(2, {"model": {"w": w}}, defer={w.data_ptr()})
        assert reached.wait(10)
        w.add_(1)  # e.g. a training loop that clamps weights after the step
        release.set()
        with pytest.raises(CheckpointError, match=r"changed in place while the snapshot of step 2.*"
                                                  r"state\['model'\]\['w'\].*memory_copy.*in_step"):
            st.settle()
        assert [s.step for s in st.own_snapshots()] == [1]
        assert torch.equal(st.load(st.own_snapshots()[0].slot)[1]["model"]["w"], torch.zeros(100))
        with pytest.raises(CheckpointError, match="snapshots stopped"):
            st.save(3, {"model": {"w": w}})
    finally:
        st.close(remove=True)


def test_memory_copy_mode_is_validated():
    from robust_plugins.config import CheckpointConfig
    from robust_plugins.errors import ConfigError

    assert CheckpointConfig(memory_every=1).memory_copy == "background"
    assert CheckpointConfig(memory_every=1, memory_copy="in_step").memory_copy == "in_step"
    with pytest.raises(ConfigError, match=r"memory_copy = 'instep' is not allowed.*in_step.*Allowed: background, in_step"):
        CheckpointConfig(memory_every=1, memory_copy="instep")


def _store_after_an_earlier_run(tmp_path, job: str, steps) -> memory.SnapshotStore:
    """A new 3-slot store of rank 0 whose slots hold ``steps`` committed by an earlier process."""
    old = memory.SnapshotStore(job, 0, 1, root=str(tmp_path), n_slots=3)
    for step in steps:
        old.save(step, {"x": torch.full((3,), float(step))})
    old.flush()
    old.close()
    return memory.SnapshotStore(job, 0, 1, root=str(tmp_path), n_slots=3)


def test_a_slot_without_a_committed_snapshot_is_overwritten_before_an_older_step(tmp_path):
    """After a rollback the new incarnation snapshots again a step an earlier one held: the
    earlier copy is retired, and the next save goes into that empty slot, not into the slot of
    the step restored from (which stays until a newer one is committed)."""
    st = _store_after_an_earlier_run(tmp_path, "order", steps=(10, 11, 12))
    try:
        st.save(12, {"x": torch.full((3,), -12.0)})  # restored 11; the old 12 goes once this commits
        assert _steps(st) == [11, 12]
        st.save(13, {"x": torch.full((3,), 13.0)})
        assert _steps(st) == [11, 12, 13]
    finally:
        st.close(remove=True)


def test_a_rollback_restore_retires_the_snapshots_after_its_bound(tmp_path):
    """The snapshots newer than a rollback's last good step hold the bad state: the restore
    retires them, so a later restore with a looser bound (the next rollback) cannot pick one,
    even when the new snapshot of that step was never committed."""
    from robust_plugins.checkpoint.restore import restore_from_memory

    st = _store_after_an_earlier_run(tmp_path, "bound", steps=(10, 11, 12))
    try:
        step, state, source = restore_from_memory(st, None, 30.0, max_step=11)
        assert (step, source, state["x"].tolist()) == (11, "memory", [11.0] * 3)
        assert _steps(st) == [10, 11]
    finally:
        st.close()
    # This incarnation died before its own snapshot of step 12 committed; the next rollback
    # allows step 12, which memory no longer holds.
    again = memory.SnapshotStore("bound", 0, 1, root=str(tmp_path), n_slots=3)
    try:
        step, state, _ = restore_from_memory(again, None, 30.0, max_step=12)
        assert (step, state["x"].tolist()) == (11, [11.0] * 3)
    finally:
        again.close(remove=True)
