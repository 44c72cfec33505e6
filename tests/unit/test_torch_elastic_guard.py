"""The guard on torch elastic's private members that robust run's agent overrides."""

import pytest

from robust_plugins.errors import HostVersionError
from robust_plugins.patches import torch_elastic


def test_installed_torch_passes():
    torch_elastic.check()


@pytest.mark.parametrize("version", ["2.15.0", "3.0.0", "2.3.1"])
def test_unsupported_version_refused_naming_the_range(version):
    with pytest.raises(HostVersionError) as info:
        torch_elastic.check(version)
    msg = str(info.value)
    assert f"torch {version}" in msg and torch_elastic.SUPPORTED in msg and "torchrun" in msg
    assert "pip install" not in msg and "never replaces your torch" in msg


def test_renamed_parameter_of_an_overridden_method_refused(monkeypatch):
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    def _monitor_workers(self, group):  # torch renamed worker_group -> group
        raise AssertionError("never called")

    monkeypatch.setattr(LocalElasticAgent, "_monitor_workers", _monitor_workers)
    with pytest.raises(HostVersionError, match=r"_monitor_workers.*self, worker_group"):
        torch_elastic.check()


def test_removed_method_refused(monkeypatch):
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    monkeypatch.delattr(SimpleElasticAgent, "_rendezvous")
    assert not hasattr(LocalElasticAgent, "_rendezvous")
    with pytest.raises(HostVersionError, match="LocalElasticAgent._rendezvous no longer exists"):
        torch_elastic.check()


def test_worker_group_field_gone_refused(monkeypatch):
    from torch.distributed.elastic.agent.server.api import WorkerGroup

    def __init__(self, spec):
        self.spec = spec
        self.workers = []
        self.rendezvous_store = None  # renamed from store
        self.group_rank = None
        self.master_addr = None
        self.master_port = None

    monkeypatch.setattr(WorkerGroup, "__init__", __init__)
    with pytest.raises(HostVersionError, match="WorkerGroup.__init__ no longer sets store"):
        torch_elastic.check()


def test_agent_is_not_built_on_a_mismatching_torch(monkeypatch):
    from robust_plugins.launcher import agent

    import dataclasses

    monkeypatch.setattr(torch_elastic, "RANGE", dataclasses.replace(torch_elastic.RANGE, minimum=(1, 0, 0),
                                                                     below=(2, 0, 0)))
    with pytest.raises(HostVersionError, match="elastic agent"):  # before torch's __init__ runs
        agent.RobustAgent(spec=None, logs_specs=None, monitor=None, node="n")


def test_rendezvous_poll_is_shortened_only_inside_the_block(monkeypatch):
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous, utils

    slept: list[float] = []
    monkeypatch.setattr(utils.time, "sleep", slept.append)
    with torch_elastic.rendezvous_poll(0.1):
        dynamic_rendezvous._delay(seconds=1)  # the SYNC poll: shortened
        dynamic_rendezvous._delay(seconds=(0.1, 0.3))  # the start-up skew: torch's
    dynamic_rendezvous._delay(seconds=1)
    assert slept[0] == 0.1 and 0.1 <= slept[1] <= 0.3 and slept[2] == 1
    assert dynamic_rendezvous._delay is utils._delay


@pytest.mark.parametrize("nodes, poll", [(1, 0.1), (10, 0.1), (50, 0.5), (100, 1.0), (4000, 1.0)])
def test_rendezvous_poll_keeps_the_store_load_bounded(nodes, poll):
    assert torch_elastic.rendezvous_poll_s(nodes) == pytest.approx(poll)
    assert nodes / torch_elastic.rendezvous_poll_s(nodes) <= max(100, nodes)  # reads a second


def test_a_rendezvous_that_polls_otherwise_is_refused(monkeypatch):
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    def run(self, state_handler, deadline, update_deadline=None):  # polls with another call
        raise AssertionError("never called")

    monkeypatch.setattr(dynamic_rendezvous._DistributedRendezvousOpExecutor, "run", run)
    with pytest.raises(HostVersionError, match=r"no longer polls with _delay\(seconds=1\)"):
        torch_elastic.check()


def test_the_state_cache_of_a_c10d_rendezvous_is_shortened_and_a_static_one_has_none():
    import socket

    from torch.distributed.elastic.rendezvous import RendezvousParameters, registry

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c10d = registry.get_rendezvous_handler(RendezvousParameters(
        backend="c10d", endpoint=f"127.0.0.1:{port}", run_id="t", min_nodes=1, max_nodes=2, is_host="true"))
    try:
        assert c10d._state_holder._cache_duration == 1  # torch's
        assert torch_elastic.shorten_state_cache(c10d, 0.1) is True
        assert c10d._state_holder._cache_duration == 0.1
    finally:
        c10d.shutdown()
    static = registry.get_rendezvous_handler(RendezvousParameters(
        backend="static", endpoint=f"127.0.0.1:{port}", run_id="t", min_nodes=1, max_nodes=1, rank=0))
    assert torch_elastic.shorten_state_cache(static, 0.1) is False

    class Holder:  # a torch whose state holder renamed its cache field
        pass

    class Handler:
        _state_holder = Holder()

    with pytest.raises(HostVersionError, match="state holder has no _cache_duration"):
        torch_elastic.shorten_state_cache(Handler(), 0.1)


def test_the_guard_lists_every_private_member_the_agent_uses():
    """Every ``self._name`` the agent's class reads, calls or overrides that it does not set itself
    is checked by the guard: a new use of a torch private fails here until the guard covers it."""
    import ast
    import inspect

    from robust_plugins.launcher import agent

    source = inspect.getsource(agent)
    used, own = set(), set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" \
                and node.attr.startswith("_") and not node.attr.startswith("__"):
            (own if isinstance(node.ctx, ast.Store) else used).add(node.attr)
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    ours = {n for n in vars(agent.RobustAgent) if not n.startswith("__") and n != "_abc_impl"}
    own |= ours
    overridden = {n for n in ours if hasattr(LocalElasticAgent, n)}
    guarded = set(torch_elastic.OVERRIDDEN) | set(torch_elastic.AGENT_FIELDS) | {torch_elastic.PCONTEXT_FIELD}
    assert overridden <= guarded, sorted(overridden - guarded)
    assert (used - own) <= guarded, sorted((used - own) - guarded)
