"""Heat map planner and outlier naming (pure; the probe itself runs in tests/distributed)."""

import itertools

import pytest

from robust_plugins.telemetry.heatmap import find_outliers, pair_rounds, render_png


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8, 33, 64])
def test_every_pair_once_and_ranks_disjoint_per_round(world):
    rounds = pair_rounds(world)
    assert len(rounds) == (world - 1 if world % 2 == 0 else world)
    seen = [p for r in rounds for p in r]
    assert sorted(seen) == list(itertools.combinations(range(world), 2))
    for r in rounds:
        ranks = [x for p in r for x in p]
        assert len(ranks) == len(set(ranks))


def test_pair_rounds_trivial():
    assert pair_rounds(1) == [] and pair_rounds(0) == []


def _matrices(world, fast=1e9, lat=50e-6):
    bw = [[None if a == b else fast for b in range(world)] for a in range(world)]
    la = [[None if a == b else lat for b in range(world)] for a in range(world)]
    return bw, la


def test_slow_host_named_and_fast_links_not():
    bw, lat = _matrices(3)
    for other in (0, 1):  # every link touching rank 2 runs at 5 % of the others
        bw[2][other] = bw[other][2] = 5e7
    out = find_outliers(bw, lat, ["node0", "node1", "node2"])
    named = {(s["src"], s["dst"]) for s in out["links"]}
    assert named == {(0, 2), (2, 0), (1, 2), (2, 1)}
    assert out["hosts"] == ["node2"]
    assert "rank 0 (node0) -> rank 2 (node2)" in out["summary"] and "suspect hosts: node2" in out["summary"]


def test_one_slow_direction_and_latency_and_classes():
    # 2 hosts x 2 ranks: intra-host links are 10x the inter-host ones; that is not an outlier.
    hosts = ["a", "a", "b", "b"]
    bw, lat = _matrices(4, fast=1e8)
    bw[0][1] = bw[1][0] = bw[2][3] = bw[3][2] = 1e9
    assert find_outliers(bw, lat, hosts)["links"] == []
    bw[1][3] = 1e7            # one direction of one link is slow
    lat[0][2] = lat[2][0] = 1e-3  # one link has 20x latency
    out = find_outliers(bw, lat, hosts)
    assert {(s["src"], s["dst"]) for s in out["links"]} == {(1, 3), (0, 2), (2, 0)}
    assert out["hosts"] == []
    assert "latency" in next(s["why"] for s in out["links"] if s["src"] == 0)


def test_png_drawn(tmp_path):
    bw, lat = _matrices(3)
    bw[0][2] = 1e7
    res = {"bw": bw, "lat": lat, "hosts": ["h0", "h1", "h2"], "nbytes": 1 << 20,
           "outliers": find_outliers(bw, lat, ["h0", "h1", "h2"])}
    png = render_png(res, tmp_path / "h.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_noise_within_a_few_x_names_nothing():
    # 4 ranks on 2 busy cores: loopback links measured 2-3x apart are noise, not slow links.
    import random

    rng = random.Random(1)
    bw, lat = _matrices(4)
    for a in range(4):
        for b in range(4):
            if a != b:
                bw[a][b] = 1e9 * rng.uniform(0.4, 1.2)
                lat[a][b] = 50e-6 * rng.uniform(0.8, 2.5)
    assert find_outliers(bw, lat, ["h"] * 4)["links"] == []
