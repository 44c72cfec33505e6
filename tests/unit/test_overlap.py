"""The host-agnostic overlap pieces (``robust_plugins.comm.overlap``) and their config keys, in one
process: the bucket planner with made-up parameter lists, the ordered sync thread and its handles."""

import threading

import pytest

from robust_plugins.comm.overlap import SyncThread, plan_buckets
from robust_plugins.config import PluginConfig
from robust_plugins.errors import ConfigError, RobustPluginsError


def test_plan_takes_parameters_last_to_first_and_closes_at_the_cap():
    sizes = [(5, "f32"), (3, "f32"), (4, "f32"), (10, "f32"), (1, "f32")]
    # Reverse order: 4 (1), 3 (10) -> 11 >= 8 closes; 2 (4), 1 (3) -> 7, 0 (5) -> 12 closes.
    assert plan_buckets(sizes, 8) == [[3, 4], [0, 1, 2]]
    assert plan_buckets(sizes, 1) == [[4], [3], [2], [1], [0]]
    assert plan_buckets(sizes, 10**9) == [[0, 1, 2, 3, 4]]


def test_plan_never_mixes_dtypes_and_covers_every_parameter_once():
    sizes = [(7, "bf16"), (2, "f32"), (2, "f32"), (9, "bf16"), (1, "bf16"), (6, "f32")]
    plan = plan_buckets(sizes, 100)
    assert plan == [[5], [3, 4], [1, 2], [0]]
    for bucket in plan:
        assert len({sizes[i][1] for i in bucket}) == 1
        assert bucket == sorted(bucket)
    assert sorted(i for b in plan for i in b) == list(range(len(sizes)))


def test_plan_at_scale_is_balanced_and_complete():
    # 10k made-up parameters of 1..5000 elements: every bucket but the last reaches the cap and
    # overshoots it by less than one parameter.
    sizes = [((i * 7919) % 5000 + 1, "f32") for i in range(10_000)]
    cap = 250_000
    plan = plan_buckets(sizes, cap)
    assert sorted(i for b in plan for i in b) == list(range(len(sizes)))
    totals = [sum(sizes[i][0] for i in b) for b in plan]
    assert all(cap <= t < cap + 5000 for t in totals[:-1]) and 0 < totals[-1] < cap + 5000
    # Reduction order follows backward: the first bucket holds the last parameters.
    assert plan[0][-1] == len(sizes) - 1 and plan[-1][0] == 0


def test_plan_refuses_bad_sizes():
    with pytest.raises(ConfigError, match="at least 1 element"):
        plan_buckets([(3, "f32")], 0)
    with pytest.raises(ConfigError, match="negative"):
        plan_buckets([(-1, "f32")], 4)


def test_sync_thread_runs_in_submission_order_and_hands_errors_to_the_waiter():
    events = []
    lock = threading.Lock()

    def on_event(event, name):
        with lock:
            events.append((event, name))

    gate = threading.Event()
    thread = SyncThread("test-sync", "test bucket", on_event)
    try:
        ran = []
        first = thread.submit("a", lambda: (gate.wait(10), ran.append("a")))
        second = thread.submit("b", lambda: ran.append("b"))

        def boom():
            raise ValueError("collective failed")

        third = thread.submit("c", boom)
        assert not first.is_completed() and not second.is_completed()  # held at "a"
        gate.set()
        first.wait(10)
        second.wait(10)
        assert ran == ["a", "b"]
        with pytest.raises(RobustPluginsError, match=r"test bucket c: .*collective failed"):
            third.wait(10)
        assert [e for e in events if e[0] == "start"] == [("start", "a"), ("start", "b"), ("start", "c")]
        assert ("done", "c") not in events and ("wait", "a") in events
    finally:
        thread.close()
    assert not thread.alive


def test_a_handle_that_never_completes_times_out_naming_the_bucket():
    thread = SyncThread("test-sync-hang", "test bucket")
    gate = threading.Event()
    try:
        handle = thread.submit("b7", lambda: gate.wait(10))
        with pytest.raises(RobustPluginsError, match="test bucket b7: .*did not finish in 0 s"):
            handle.wait(0.2)
    finally:
        gate.set()
        thread.close()


def test_overlap_and_bucket_mb_keys():
    cfg = PluginConfig.from_dict({"compression": {"codec": "int8"}}).compression
    assert cfg.overlap is None and cfg.bucket_mb is None  # unset: the device's default
    cfg = PluginConfig.from_dict({"compression": {"codec": "int8", "overlap": False, "bucket_mb": 0.5}}).compression
    assert cfg.overlap is False and "overlap=False, bucket_mb=0.5" in cfg.describe()
    for bad, match in (({"overlap": "yes"}, "overlap must be true, false or null"),
                       ({"bucket_mb": -1}, "bucket_mb = -1 must be a finite number"),
                       ({"bucket_mb": float("inf")}, "bucket_mb = inf"),
                       ({"bucket_mb": True}, "bucket_mb must be a number"),
                       ({"overlap": True, "codec": "sign", "sign_mode": "momentum", "freeze_steps": 3},
                        "overlap = true does not apply to sign_mode = 'momentum'"),
                       ({"overlaps": True}, "Did you mean 'overlap'")):
        with pytest.raises(ConfigError, match=match):
            PluginConfig.from_dict({"compression": {"codec": "int8", **bad}})


def test_megatron_refuses_an_overlap_or_bucket_size_it_would_not_follow():
    from types import SimpleNamespace

    from robust_plugins.errors import UnsupportedError
    from robust_plugins.patches import megatron as patch

    ddp = SimpleNamespace(ddp_config=SimpleNamespace(use_distributed_optimizer=False, overlap_grad_reduce=False))
    want_overlap = patch._as_plugin_config({"compression": {"codec": "int8", "overlap": True}})
    with pytest.raises(UnsupportedError, match="overlap_grad_reduce = False"):
        patch._refuse_config(want_overlap, ddp)
    ddp.ddp_config.overlap_grad_reduce = True
    patch._refuse_config(want_overlap, ddp)  # agrees with megatron's own switch
    with pytest.raises(UnsupportedError, match="bucket_mb = 8 sizes DeepSpeed ZeRO 0's buckets"):
        patch._refuse_config(patch._as_plugin_config({"compression": {"codec": "int8", "bucket_mb": 8}}), ddp)
    # An explicit value equal to the CPU default is still the user's setting, refused alike.
    with pytest.raises(UnsupportedError, match="bucket_mb = 4 sizes DeepSpeed ZeRO 0's buckets"):
        patch._refuse_config(patch._as_plugin_config({"compression": {"codec": "int8", "bucket_mb": 4}}), ddp)


@pytest.mark.timeout(60)
def test_the_hierarchys_flat_fallback_reduces_over_the_group_it_is_given(monkeypatch):
    # A sync thread hands its own clone of the host's group; the uneven layout's flat fallback
    # must reduce over that clone, not over the host's group the hierarchy was planned with
    # (which the training thread drives).
    import torch

    from robust_plugins import topology
    from robust_plugins.comm.gradient_sync import GradientSync
    from robust_plugins.config import PluginConfig
    from robust_plugins.topology.builder import TopologyGroups

    cfg = PluginConfig.from_dict({"compression": {"codec": "int8"}, "topology": {"hierarchical": True}})
    sync = GradientSync(cfg.compression, step_fn=lambda: 100, topology=cfg.topology)
    sync._hierarchies[("none",)] = TopologyGroups(plan=None, fallback_reason="uneven layout", group="host-group")
    seen = []
    monkeypatch.setattr(topology, "hierarchical_all_reduce", lambda t, groups, **k: seen.append(groups.group) or t)
    sync.all_reduce_sum(torch.zeros(8), "thread-clone", "b0")
    sync.all_reduce_sum(torch.zeros(8), "host-group", "b0")
    assert seen == ["thread-clone", "host-group"]
