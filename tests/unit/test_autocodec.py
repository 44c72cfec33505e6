"""The ``auto`` codec's pure decision function with made-up numbers, and its measurements in one process."""

from __future__ import annotations

import math

import pytest
import torch

from robust_plugins.comm.auto_measure import measure_codec
from robust_plugins.comm.auto_model import CodecCost, LinkEstimate, bytes_per_element, choose_codec, predict_seconds
from robust_plugins.comm.autocodec import AutoCodec
from robust_plugins.config import CompressionConfig, PluginConfig
from robust_plugins.errors import ConfigError

# Costs of the order measured on this machine's CPU (plain-torch codecs): seconds per element of
# one rank's encode + reduce + decode, and one round trip's relative error on a gradient.
COSTS = {"bf16": CodecCost(3e-9, 0.003), "bf16_allreduce": CodecCost(1.5e-9, 0.004), "int8": CodecCost(12e-9, 0.01),
         "int4": CodecCost(15e-9, 0.15)}
N = 16 * 2**20  # 64 MB of fp32


def link(gbit: float, w: int = 2, latency: float = 2e-4) -> LinkEstimate:
    return LinkEstimate(gbit * 1e9 / 8, latency, w)


def test_bytes_per_element_include_the_scales():
    assert bytes_per_element("none", 256) == 4 and bytes_per_element("bf16", 256) == 2
    assert bytes_per_element("int8", 256) == 1 + 4 / 256 and bytes_per_element("int4", 128) == 0.5 + 4 / 128
    with pytest.raises(ConfigError, match="allowed: none"):
        bytes_per_element("fp8", 256)


def test_prediction_follows_the_cost_model():
    lk = link(0.2, w=4)
    # none: one all-reduce: latency + 2 (W-1)/W n 4 / bandwidth.
    assert predict_seconds("none", N, lk, None, 256) == pytest.approx(2e-4 + 1.5 * N * 4 / 25e6)
    assert predict_seconds("int8", N, lk, COSTS["int8"], 256) == pytest.approx(
        4e-4 + 1.5 * N * (1 + 4 / 256) / 25e6 + N * 12e-9)


def test_fast_link_keeps_none():
    d = choose_codec(N, link(100), COSTS)
    assert d.codec == "none" and d.reason == "none is predicted fastest"
    assert d.predicted_s["none"] < d.predicted_s["bf16_allreduce"] < d.predicted_s["bf16"] < d.predicted_s["int8"]


def test_fast_link_picks_the_plain_bf16_allreduce_over_the_two_phase_codecs():
    # At 10 Gbit/s half the bytes pay for a cast, but not for the two-phase codecs' encode and
    # second collective: bf16_allreduce (one collective, 2 bytes an element) beats none and bf16.
    lk = link(10, w=4)
    d = choose_codec(N, lk, COSTS)
    assert d.codec == "bf16_allreduce" and "faster than none" in d.reason, d
    p = d.predicted_s
    assert p["bf16_allreduce"] < 0.9 * p["none"] and p["none"] < p["bf16"]
    # One collective: one latency, not two, and the wire bytes of bf16.
    assert p["bf16_allreduce"] == pytest.approx(2e-4 + 1.5 * N * 2 / 1.25e9 + N * 1.5e-9)
    assert bytes_per_element("bf16_allreduce", 256) == 2
    # The quality guard applies to it like to any codec (its error includes the backend's bf16 sums).
    strict = choose_codec(N, lk, COSTS, max_error=0.0035)
    assert strict.codec == "none" and strict.excluded["bf16_allreduce"] == "error 0.004 > max_error 0.0035"
    # Without it, the fast link stays uncompressed, as before it existed.
    assert choose_codec(N, lk, COSTS, candidates=("none", "bf16", "int8")).codec == "none"


def test_slow_link_picks_int8_and_the_guard_excludes_int4():
    d = choose_codec(N, link(0.2), COSTS)
    assert d.codec == "int8", d
    assert d.excluded == {"int4": "error 0.15 > max_error 0.1"}
    assert d.predicted_s["int8"] < d.predicted_s["bf16"] < d.predicted_s["none"]
    # A looser guard lets int4 (even fewer bytes) win.
    assert choose_codec(N, link(0.2), COSTS, max_error=0.2).codec == "int4"
    assert choose_codec(N, link(0.2), COSTS, candidates=("none", "bf16")).codec == "bf16"


def test_per_bucket_size_small_buckets_stay_uncompressed():
    # Two collectives' latency outweigh the bytes saved on a tiny bucket, not on a big one.
    lk = link(1, latency=1e-3)
    assert choose_codec(1_000, lk, COSTS).codec == "none"
    assert choose_codec(N, link(0.2, latency=1e-3), COSTS).codec == "int8"


def test_min_gain_hysteresis():
    # Find a rate where int8 is predicted a little faster than none: min_gain keeps none.
    for gbit in (x / 100 for x in range(100, 1000)):
        d = choose_codec(N, link(gbit), COSTS, min_gain=0.0)
        if d.codec == "none":
            break
        last = gbit
    near = choose_codec(N, link(last), COSTS, min_gain=0.0)
    assert near.codec != "none"
    kept = choose_codec(N, link(last), COSTS, min_gain=0.1)
    assert kept.codec == "none" and "< min_gain 10%" in kept.reason


def test_group_of_one_and_bad_inputs():
    assert choose_codec(N, LinkEstimate(math.inf, 0.0, 1), COSTS).codec == "none"
    with pytest.raises(ConfigError, match="min_gain"):
        choose_codec(N, link(1), COSTS, min_gain=1.0)
    with pytest.raises(ConfigError, match="must be > 0"):
        choose_codec(N, LinkEstimate(0.0, 0.0, 2), COSTS)
    with pytest.raises(ConfigError, match="allowed are none, bf16, bf16_allreduce, int8, int4"):
        AutoCodec(candidates=("sign",))


def test_measure_codec_on_a_real_tensor():
    g = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0))
    int8, int4, bf16 = (measure_codec(c, g, 4, 256) for c in ("int8", "int4", "bf16"))
    assert 0.002 < int8.rel_error < 0.02 and 0.05 < int4.rel_error < 0.3 and bf16.rel_error < 0.005
    assert all(c.seconds_per_element > 0 for c in (int8, int4, bf16))


def test_auto_codec_without_a_process_group_decides_none_and_records_it():
    auto = AutoCodec(recheck_steps=2)
    t = torch.randn(4096)
    assert auto.decide(t).codec == "none"
    assert auto.decisions()[0]["reason"] == "group of one: nothing crosses a link"
    assert len(auto.history) == 1 and auto.history[0]["numel"] == 4096
    auto.decide(t)
    assert len(auto.history) == 1  # cached until the re-check
    auto.decide(t)
    assert len(auto.history) == 2  # step (call count) advanced by recheck_steps: probed again


def test_config_accepts_auto_and_checks_its_keys():
    cfg = PluginConfig.from_dict({"compression": {"codec": "auto", "auto_candidates": ["none", "int8"],
                                                  "auto_link_gbit": 0.2}}).compression
    assert cfg.auto_candidates == ("none", "int8") and cfg.compresses
    assert "auto_link_gbit=0.2" in cfg.describe()
    for bad, match in ((dict(auto_candidates="int8"), "non-empty list"), (dict(auto_link_gbit=0), "> 0"),
                       (dict(auto_recheck_steps=-1), ">= 0"), (dict(auto_max_error=1.5), r"\[0, 1\)")):
        with pytest.raises(ConfigError, match=match):
            CompressionConfig(codec="auto", **bad)


def test_gradient_sync_auto_keeps_one_state_per_codec_and_refuses_the_single_state():
    from robust_plugins.comm.gradient_sync import GradientSync
    from robust_plugins.errors import UnsupportedError

    # By default bf16_allreduce is DeepSpeed's plain bf16 all-reduce: no residual to keep.
    assert sorted(GradientSync(CompressionConfig(codec="auto"), step_fn=lambda: 0).states) == ["bf16", "int4", "int8"]
    sync = GradientSync(CompressionConfig(codec="auto", auto_bf16_error_feedback=True), step_fn=lambda: 0)
    assert sorted(sync.states) == ["bf16", "bf16_allreduce", "int4", "int8"]
    # bf16_allreduce's residuals (of its cast) live in a bf16 state: the rounding it feeds back.
    assert sync.states["bf16_allreduce"].codec == "bf16" and sync.states["bf16_allreduce"].error_feedback
    with pytest.raises(UnsupportedError, match="chooses the codec per bucket"):
        sync.state  # noqa: B018
    t = torch.randn(1000)
    want = t.clone()
    sync.all_reduce_sum(t, None, sync.compress_key("site", t.numel()))
    assert torch.equal(t, want) and sync.stats.by_codec == {"none": 1000}  # world of one: none
    assert sync.stats.auto_decisions[0]["codec"] == "none"
    assert set(sync.state_dict()["compression_auto"]) == {"bf16", "bf16_allreduce", "int4", "int8"}


def test_a_single_compression_state_refuses_auto():
    from robust_plugins.comm import CompressionState

    with pytest.raises(ConfigError, match="needs a fixed codec.*decided per bucket by"):
        CompressionState(codec="auto")


# -- routes: flat or hierarchical, and the codec (topology.hierarchical with auto) ---------------
from robust_plugins.comm.auto_measure import rerun_routes  # noqa: E402
from robust_plugins.comm.auto_model import choose_route, predict_route_seconds, trial_routes  # noqa: E402


def links(inter_gbit: float, intra_gbit: float, world: int = 4, per_node: int = 2) -> dict:
    return {"flat": link(inter_gbit, w=world), "intra": link(intra_gbit, w=per_node),
            "rail": link(inter_gbit, w=world // per_node)}


def test_route_prediction_adds_the_node_steps_to_the_rail_step():
    lk = links(0.2, 20)
    # hier c: one fp32 all-reduce of n on the node + the codec on n / 2 over the rail.
    assert predict_route_seconds("hier int8", N, lk, COSTS, 256, 2) == pytest.approx(
        predict_seconds("none", N, lk["intra"], None, 256) + predict_seconds("int8", N // 2, lk["rail"], COSTS["int8"], 256))
    assert predict_route_seconds("flat bf16", N, lk, COSTS, 256, 2) == predict_seconds("bf16", N, lk["flat"], COSTS["bf16"], 256)
    with pytest.raises(ConfigError, match="flat or hier"):
        predict_route_seconds("ring int8", N, lk, COSTS, 256, 2)


def test_route_model_slow_link_goes_hierarchical_fast_link_stays_flat_none():
    slow = choose_route(N, links(0.2, 20), COSTS, per_node=2)
    assert slow.route == "hier int8" and slow.layout == "hier", slow
    assert "predicted" in slow.reason and slow.excluded == {"int4": "error 0.15 > max_error 0.1"}
    # A fast inter-node link with a node link no faster (loopback on shared cores): flat, and the
    # plain bf16 all-reduce (half the bytes for a cheap cast) ahead of none.
    fast = choose_route(N, links(10, 10), COSTS, per_node=2)
    assert fast.route == "flat bf16_allreduce", fast
    assert fast.predicted_s["flat none"] < fast.predicted_s["hier none"]
    # bf16_allreduce is a whole-bucket collective, never the rail step of the hierarchy.
    assert "hier bf16_allreduce" not in fast.predicted_s and "hier bf16" in fast.predicted_s
    with pytest.raises(ConfigError, match="flat route only"):
        predict_route_seconds("hier bf16_allreduce", N, links(10, 10), COSTS, 256, 2)
    without = choose_route(N, links(10, 10), COSTS, per_node=2, candidates=("none", "bf16", "int8"))
    assert without.route == "flat none", without
    # Without the hierarchy only flat routes exist.
    flat = choose_route(N, links(0.2, 20), COSTS, per_node=2, hierarchical=False)
    assert flat.layout == "flat" and all(r.startswith("flat ") for r in flat.predicted_s)


def test_measured_bf16_allreduce_wins_only_by_min_gain():
    lk = links(10, 10)
    d = choose_route(N, lk, COSTS, per_node=2, measured={"flat none": 0.100, "flat bf16_allreduce": 0.080,
                                                          "flat bf16": 0.120})
    assert d.route == "flat bf16_allreduce" and d.codec == "bf16_allreduce" and "20% faster than flat none" in d.reason
    d = choose_route(N, lk, COSTS, per_node=2, measured={"flat none": 0.100, "flat bf16_allreduce": 0.095})
    assert d.route == "flat none" and "only 5% faster" in d.reason
    with pytest.raises(ConfigError, match="not candidates"):
        choose_route(N, lk, COSTS, per_node=2, measured={"hier bf16_allreduce": 0.01})


def test_measure_bf16_allreduce_counts_the_backends_bf16_sums():
    g = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0))
    two, eight = measure_codec("bf16_allreduce", g, 2, 256), measure_codec("bf16_allreduce", g, 8, 256)
    cast = float((g.to(torch.bfloat16).float() - g).norm() / g.norm())
    # More ranks, more bf16 roundings of partial sums: the guard's error grows with the group,
    # and is above one cast's round trip.
    assert cast < two.rel_error < eight.rel_error < 0.02, (cast, two, eight)
    assert two.seconds_per_element > 0
    # A group of one sends nothing but still casts: the cast's error alone.
    assert measure_codec("bf16_allreduce", g, 1, 256).rel_error == pytest.approx(cast, rel=1e-6)


def test_measured_times_overrule_the_model_and_min_gain_keeps_exact():
    lk = links(0.2, 20)
    # The model says hier int8; the trials say the flat all-reduce is fastest: measured wins.
    d = choose_route(N, lk, COSTS, per_node=2, measured={"flat none": 0.10, "hier int8": 0.30, "hier none": 0.5})
    assert d.route == "flat none" and d.measured_s["hier int8"] == 0.30 and "measured" in d.reason
    # A lossy route only 5 % faster than the best exact one does not replace it (min_gain 10 %).
    d = choose_route(N, lk, COSTS, per_node=2, measured={"flat none": 0.100, "flat int8": 0.095})
    assert d.route == "flat none" and "only 5% faster" in d.reason
    d = choose_route(N, lk, COSTS, per_node=2, measured={"flat none": 0.100, "hier int8": 0.05})
    assert d.route == "hier int8" and "50% faster than flat none" in d.reason
    with pytest.raises(ConfigError, match="not candidates"):
        choose_route(N, lk, COSTS, per_node=2, measured={"hier int4": 0.01})  # int4 fails the guard
    with pytest.raises(ConfigError, match="per_node"):
        choose_route(N, lk, COSTS, per_node=0)


def test_trial_routes_prune_clear_losers_but_keep_an_exact_baseline():
    pred = {"flat none": 10.0, "flat int8": 2.0, "hier none": 8.0, "hier int8": 1.0, "hier bf16": 3.9}
    assert trial_routes(pred, 4.0) == ["flat int8", "hier bf16", "hier int8", "hier none"]
    assert trial_routes({"flat none": 1.0, "hier none": 9.0}) == ["flat none"]


def test_rerun_gives_a_route_the_model_favoured_a_second_look():
    # The run that motivated it: one 259 ms sample of bf16_allreduce against 42 ms for none,
    # though the model predicted it fastest; it is run again, the clear losers are not.
    measured = {"flat none": 0.042, "flat bf16_allreduce": 0.259, "flat bf16": 0.219, "hier int8": 0.305}
    predicted = {"flat none": 0.041, "flat bf16_allreduce": 0.028, "flat bf16": 0.043, "hier int8": 0.109}
    assert rerun_routes(measured, predicted) == ["flat bf16", "flat bf16_allreduce", "flat none"]
    # Measured close contenders are rerun whatever the model said; a lone winner is not rerun.
    assert rerun_routes({"a": 1.0, "b": 1.2, "c": 2.0}, {}) == ["a", "b"]
    assert rerun_routes({"a": 1.0, "b": 3.0}, {"a": 1.0, "b": 2.0}) == ["a"]


def test_step_gain_sums_the_buckets_of_a_step_against_flat_none():
    from robust_plugins.comm.auto_model import Decision, step_gain

    def d(route, measured, predicted=None):
        layout, codec = route.split()
        return Decision(1000, codec, predicted or {}, "test", layout=layout, measured_s=measured)

    none = d("flat none", {"flat none": 0.010, "flat bf16_allreduce": 0.012})
    assert step_gain([none, none]) == 0.0
    # One bucket 30 % faster as bf16, the other three uncompressed: 7.5 % of the step (< 10 %).
    bf16 = d("flat bf16_allreduce", {"flat none": 0.010, "flat bf16_allreduce": 0.007})
    assert step_gain([none, none, none, bf16]) == pytest.approx(0.075)
    # On a slow link every bucket saves a lot: far above min_gain.
    hier = d("hier int8", {"flat none": 0.200, "hier int8": 0.070})
    assert step_gain([hier, hier]) == pytest.approx(0.65)
    # A route that was not run counts its prediction.
    pred = d("hier int8", {"hier int8": 0.05}, predicted={"flat none": 0.1, "hier int8": 0.04})
    assert step_gain([pred]) == pytest.approx(0.5)
    with pytest.raises(ConfigError, match="any host route"):
        step_gain([d("hier int8", {"hier int8": 0.05})])
    # Every bucket chose bf16_allreduce: the host's one bucket could send bf16 too, nothing saved.
    fast = d("flat bf16_allreduce", {"flat none": 0.010, "flat bf16_allreduce": 0.008})
    assert step_gain([fast, fast, fast]) == pytest.approx(0.0)
    # Mixed: measured against the better uniform wire (none: 0.030 + 0.010 vs bf16: 0.024 + 0.012).
    assert step_gain([fast, fast, fast, none]) == pytest.approx(1 - 0.034 / 0.036)


def test_hand_back_when_every_bucket_went_flat_none_or_the_routes_save_too_little():
    from robust_plugins.comm.auto_model import Decision, hand_back_reason

    def d(route, measured):
        layout, codec = route.split()
        return Decision(1000, codec, {}, "test", layout=layout, measured_s=measured)

    none = d("flat none", {"flat none": 0.010, "flat bf16_allreduce": 0.012})
    bf16 = d("flat bf16_allreduce", {"flat none": 0.010, "flat bf16_allreduce": 0.007})
    hier = d("hier int8", {"flat none": 0.200, "hier int8": 0.070})
    assert "flat all-reduce for all 2 buckets" in hand_back_reason(["flat none"] * 2, [None, None], 0.1)
    routes = ["flat none"] * 3 + ["flat bf16_allreduce"]
    assert "save 8% of the time" in hand_back_reason(routes, [none, none, none, bf16], 0.1)
    assert hand_back_reason(routes, [none, none, none, bf16], 0.05) is None
    assert hand_back_reason(["hier int8"] * 2, [hier, hier], 0.1) is None
    assert hand_back_reason(["flat int8", "flat none"], [None, none], 0.1) is None  # no route plan: keep
    assert hand_back_reason([], [], 0.1) is None


def test_gradient_sync_hands_back_only_auto_steps_without_warm_up_keys():
    from robust_plugins.comm.gradient_sync import GradientSync

    fixed = GradientSync(CompressionConfig(codec="int8"), step_fn=lambda: 0)
    assert fixed.hand_back_reason(["site:0"]) is None
    sync = GradientSync(CompressionConfig(codec="auto"), step_fn=lambda: 0)
    t = torch.randn(1000)
    key = sync.compress_key("site", t.numel())
    sync.all_reduce_sum(t, None, key)  # world of one: the codec-only decision, none
    assert sync.route_of(key) == "flat none" and sync.decision_of(key) is None
    assert "for all 1 buckets" in sync.hand_back_reason([key])
    assert sync.hand_back_reason([key, None]) is None  # a warm-up bucket: nothing was decided


def test_host_wire_is_fp32_without_bf16_among_the_candidates_or_its_measured_error():
    auto = AutoCodec(candidates=("none", "int8"))
    assert auto.host_wire(lambda: pytest.fail("timed"), None) == (
        "fp32", "bf16_allreduce is not among auto_candidates", {})
    auto = AutoCodec(candidates=("none", "bf16_allreduce"))
    assert auto.host_wire(lambda: pytest.fail("timed"), None)[:2] == (
        "fp32", "no probe measured bf16_allreduce's error")


def test_host_wire_bf16_only_by_min_gain_on_medians_and_within_the_guard():
    from robust_plugins.comm.auto_model import choose_host_wire

    fp32 = [0.050, 0.049, 0.080, 0.051, 0.050]  # one slow spell: the median ignores it
    assert choose_host_wire(fp32, [0.044, 0.043, 0.044, 0.090, 0.044], 3e-3, min_gain=0.1, max_error=0.1)[0] == "bf16"
    wire, why = choose_host_wire(fp32, [0.047] * 5, 3e-3, min_gain=0.1, max_error=0.1)
    assert wire == "fp32" and "less than min_gain 10%" in why
    wire, why = choose_host_wire(fp32, [0.020] * 5, 0.2, min_gain=0.1, max_error=0.1)
    assert wire == "fp32" and "quality guard" in why
    with pytest.raises(ConfigError, match="as many"):
        choose_host_wire([0.05], [], 0.0, min_gain=0.1, max_error=0.1)


def test_auto_bf16_error_feedback_is_a_checked_bool_and_prices_the_feedback():
    from robust_plugins.comm.auto_measure import measure_bf16_allreduce

    with pytest.raises(ConfigError, match="auto_bf16_error_feedback"):
        PluginConfig.from_dict({"compression": {"codec": "auto", "auto_bf16_error_feedback": "yes"}})
    on = CompressionConfig(codec="auto", auto_bf16_error_feedback=True)
    assert "auto_bf16_error_feedback=True" in on.describe()
    g = torch.randn(1 << 16)
    # The guard's error is the backend's bf16 sums either way; only the priced compute differs.
    plain, fed = measure_bf16_allreduce(g, 4), measure_bf16_allreduce(g, 4, error_feedback=True)
    assert plain.rel_error == fed.rel_error > 0 and plain.seconds_per_element > 0


def test_measured_error_is_the_largest_over_the_probes_in_force():
    auto = AutoCodec(candidates=("none", "bf16_allreduce", "int8"))
    assert auto.measured_error("bf16_allreduce") is None
    auto._probes = {("a",): (0, None, {"bf16_allreduce": CodecCost(1e-9, 0.002)}),
                    ("b",): (0, None, {"bf16_allreduce": CodecCost(1e-9, 0.003), "int8": CodecCost(1e-9, 0.01)})}
    assert auto.measured_error("bf16_allreduce") == 0.003 and auto.measured_error("int4") is None


def test_gradient_sync_names_the_key_to_compress_under_or_why_not():
    from robust_plugins.comm.gradient_sync import GradientSync

    sync = GradientSync(CompressionConfig(codec="int8", min_numel=100), step_fn=lambda: 0)
    assert sync.passthrough_reason(10) == "below min_numel" and sync.passthrough_reason(1000) is None
    assert sync.compress_key("site", 1000) == "site:0"  # the error-feedback key
    assert sync.compress_key("site", 10) is None and sync.compress_key("site", 1000) == "site:2"


def test_link_latencies_are_interleaved_barriered_and_the_best_counts(monkeypatch):
    """auto compares the flat all-reduce against the node and rail steps built from these
    latencies: their samples alternate (a slow spell hits every kind), each after a barrier of its
    group, and each kind's fastest sample counts; a size-1 group sends nothing."""
    import torch.distributed as dist

    from robust_plugins.comm import auto_measure

    calls, clock = [], {"t": 0.0}
    slow = {"flat": [0.009, 0.009, 0.002, 0.009, 0.009], "intra": [0.001] * 5, "rail": [0.003] * 5}

    class FakeClock:
        def __init__(self, device):
            pass

        def start(self):
            self.t0 = clock["t"]
            return self

        def stop(self):
            return clock["t"] - self.t0

    def all_reduce(t, group):
        calls.append(("all_reduce", group, t.numel()))
        if t.numel() == 1:
            clock["t"] += slow[group].pop(0)
        else:
            clock["t"] += 0.5

    monkeypatch.setattr(dist, "get_world_size", lambda group: {"flat": 4, "intra": 2, "rail": 2, "one": 1}[group])
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "barrier", lambda group: calls.append(("barrier", group)))
    monkeypatch.setattr(auto_measure, "collective_device", lambda group: torch.device("cpu"))
    monkeypatch.setattr(auto_measure, "ranks_of", lambda group: (group,))
    monkeypatch.setattr(auto_measure, "Clock", FakeClock)
    out = auto_measure.measure_links({"flat": "flat", "intra": "intra", "rail": "rail", "none": "one"},
                                     {"flat": 1000.0, "intra": None, "rail": 1000.0}, probe_bytes=4096)
    tiny = [c[1] for c in calls if c[0] == "all_reduce" and c[2] == 1]
    assert tiny == ["flat", "intra", "rail"] * auto_measure.LATENCY_ROUNDS
    assert all(calls[i - 1] == ("barrier", c[1]) for i, c in enumerate(calls) if c[0] == "all_reduce")
    assert out["flat"][0] == pytest.approx(0.002) and out["rail"][0] == pytest.approx(0.003)
    assert out["flat"][1] == pytest.approx(8 / 1e12) and out["none"] == (0.0, 0.0, 1)
    # The node link's rate is measured: one 1024-element all-reduce, its latency taken off.
    assert [c for c in calls if c[0] == "all_reduce" and c[2] > 1] == [("all_reduce", "intra", 1024)]
    assert out["intra"] == (pytest.approx(0.001), pytest.approx((0.5 - 0.001) / (1024 * 4)), 2)


def test_hier_none_replaces_flat_none_only_by_min_gain():
    lk = links(10, 10)
    d = choose_route(N, lk, COSTS, per_node=2, measured={"flat none": 0.100, "hier none": 0.095})
    assert d.route == "flat none" and "hier none measured only 5% faster than flat none" in d.reason, d.reason
    d = choose_route(N, lk, COSTS, per_node=2, measured={"flat none": 0.100, "hier none": 0.080})
    assert d.route == "hier none" and d.reason == "hier none measured fastest", d.reason
    # A lossy route is weighed against the exact route that stands: here flat none.
    d = choose_route(N, lk, COSTS, per_node=2, measured={"flat none": 0.100, "hier none": 0.095, "hier int8": 0.092})
    assert d.route == "flat none" and "only 8% faster than flat none" in d.reason, d.reason


def test_reduce_scatter_model_moves_half_the_bytes_in_one_collective():
    from robust_plugins.comm.auto_model import predict_reduce_scatter_seconds

    lk = link(1, w=4)
    bus = 3 / 4 * N * 4 / lk.bus_bytes_per_s
    assert predict_reduce_scatter_seconds("none", N, lk, None, 256) == pytest.approx(lk.latency_s + bus)
    int8 = 3 / 4 * N * bytes_per_element("int8", 256) / lk.bus_bytes_per_s
    assert predict_reduce_scatter_seconds("int8", N, lk, COSTS["int8"], 256) == pytest.approx(
        lk.latency_s + int8 + N * COSTS["int8"].seconds_per_element)
    assert predict_route_seconds("hier int8", N, links(0.2, 20), COSTS, 256, 2, "reduce_scatter") == pytest.approx(
        predict_reduce_scatter_seconds("none", N, links(0.2, 20)["intra"], None, 256)
        + predict_reduce_scatter_seconds("int8", N // 2, links(0.2, 20)["rail"], COSTS["int8"], 256))
    with pytest.raises(ConfigError, match="not a reduce-scatter"):
        predict_reduce_scatter_seconds("bf16_allreduce", N, lk, COSTS["bf16_allreduce"], 256)
    with pytest.raises(ConfigError, match="collective"):
        predict_route_seconds("flat none", N, links(0.2, 20), COSTS, 256, 2, "broadcast")


def test_reduce_scatter_routes_slow_link_hierarchical_and_no_whole_bucket_allreduce():
    slow = choose_route(N, links(0.2, 20), COSTS, per_node=2, collective="reduce_scatter")
    assert slow.route == "hier int8" and slow.collective == "reduce_scatter", slow
    assert slow.to_dict()["collective"] == "reduce_scatter"
    fast = choose_route(N, links(10, 10), COSTS, per_node=2, collective="reduce_scatter")
    assert not any("bf16_allreduce" in r for r in fast.predicted_s)
    assert fast.excluded["bf16_allreduce"] == "an all-reduce, not a reduce-scatter"
    assert fast.layout == "flat", fast
