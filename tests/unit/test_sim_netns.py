"""Simulator pieces that need no root: rate parsing, argument checks, the missing-tool message."""

from __future__ import annotations

import pytest

from robust_plugins.errors import ConfigError
from robust_plugins.sim import SimCluster, format_rate, parse_rate
from robust_plugins.sim import netns


@pytest.mark.parametrize("text,bits", [("200mbit", 2e8), ("10gbit", 1e10), ("1.5Gbit", 1.5e9),
                                       ("500kbit", 5e5), (" 64000 ", 64e3), (2e8, 2e8)])
def test_parse_rate(text, bits):
    assert parse_rate(text) == bits


def test_format_rate_round_trips():
    for text in ("200mbit", "10gbit", "1.5gbit", "500kbit"):
        assert format_rate(parse_rate(text)) == text


@pytest.mark.parametrize("bad,match", [("fast", "not a rate"), ("10 gbyte", "not a rate"),
                                       ("1bit", "outside"), (True, "not a rate")])
def test_parse_rate_refuses(bad, match):
    with pytest.raises(ConfigError, match=match):
        parse_rate(bad)


def test_cluster_refuses_bad_sizes():
    with pytest.raises(ConfigError, match="nodes = 0 must be an int in \\[1, 200\\]"):
        SimCluster(nodes=0, ranks_per_node=2)
    with pytest.raises(ConfigError, match="ranks_per_node = 2.0 must be an int"):
        SimCluster(nodes=2, ranks_per_node=2.0)


def test_unavailable_reason_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert "needs root" in netns.netns_unavailable_reason()
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/ip")
    assert netns.netns_unavailable_reason().endswith("not found on PATH: tc")
    with pytest.raises(netns.SimError, match="not found on PATH: tc"):
        netns.require_netns()
