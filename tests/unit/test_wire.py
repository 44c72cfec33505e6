"""WireCounter patching and restoring, without a process group."""

from __future__ import annotations

import sys

import pytest
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from robust_plugins.comm import WireCounter
from robust_plugins.comm.wire import INTERCEPTED


def originals():
    return {(m.__name__, n): getattr(m, n, None) for m in (dist, c10d) for n in INTERCEPTED}


def test_functions_are_wrapped_inside_and_restored_after():
    before = originals()
    with WireCounter():
        assert dist.all_reduce is not before[("torch.distributed", "all_reduce")]
        assert dist.all_reduce.__wrapped__ is before[("torch.distributed", "all_reduce")]
        # torch.distributed re-exports distributed_c10d: both names see the same wrapper.
        assert c10d.all_to_all_single is dist.all_to_all_single
    assert originals() == before


def test_restored_on_exception_and_after_nesting():
    before = originals()
    with pytest.raises(KeyError):
        with WireCounter():
            with WireCounter():
                pass
            assert dist.broadcast is not before[("torch.distributed", "broadcast")]  # outer still on
            raise KeyError("boom")
    assert originals() == before


def test_counters_start_empty():
    wc = WireCounter()
    assert wc.bytes_sent == 0 and not wc.calls and not wc.by_op


def test_a_deepspeed_backend_without_its_bound_collectives_is_an_error_not_an_undercount(monkeypatch):
    import types

    from robust_plugins.errors import HostVersionError
    from robust_plugins.patches import deepspeed_wire

    monkeypatch.setitem(sys.modules, "deepspeed.comm.comm", types.SimpleNamespace(cdb=None))
    assert deepspeed_wire.bound_collectives() == []  # no backend built yet: nothing to wrap
    backend = types.SimpleNamespace(all_gather_function=lambda *a, **k: None)
    monkeypatch.setitem(sys.modules, "deepspeed.comm.comm", types.SimpleNamespace(cdb=backend))
    with pytest.raises(HostVersionError, match=r"no reduce_scatter_function.*deepspeed >=\d"):
        deepspeed_wire.bound_collectives()
    backend.reduce_scatter_function = lambda *a, **k: None
    assert [(o is backend, a, n) for o, a, n in deepspeed_wire.bound_collectives()] == [
        (True, "all_gather_function", "all_gather_into_tensor"),
        (True, "reduce_scatter_function", "reduce_scatter_tensor")]
