"""WireCounter's byte model on 2 gloo ranks, nesting, and what it sees of deepspeed.comm."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks
from robust_plugins.comm import WireCounter

pytestmark = pytest.mark.distributed

NB = 4 * 1000  # bytes of a 1000-element fp32 tensor


def _bus_model(rank: int, world: int) -> dict:
    t = torch.ones(1000)
    out = {}
    with WireCounter() as outer:
        with WireCounter() as wc:
            dist.all_reduce(t)
            dist.broadcast(t, src=0)
            dist.all_gather([torch.empty(1000) for _ in range(world)], t)
            dist.all_gather_into_tensor(torch.empty(world * 1000), t)
            dist.reduce_scatter_tensor(torch.empty(500), torch.ones(1000))
            # Uneven all-to-all: rank 0 sends 3 rows to itself and 1 to rank 1; rank 1 the reverse.
            splits = [3, 1] if rank == 0 else [1, 3]
            recv = [3, 1] if rank == 0 else [1, 3]
            dist.all_to_all_single(torch.empty(4, 250), torch.ones(4, 250), recv, splits)
            if rank == 0:
                dist.send(t, 1)
            else:
                dist.recv(t, 0)
        out["inner"] = (wc.bytes_sent, dict(wc.calls), dict(wc.by_op))
    out["outer"] = (outer.bytes_sent, dict(outer.calls))
    return out


@pytest.mark.timeout(120)
def test_bus_model_and_nesting():
    res = run_ranks(_bus_model, 2, 90)
    for rank in range(2):
        total, calls, by_op = res[rank]["inner"]
        assert by_op["all_reduce"] == NB  # 2 (W-1)/W
        assert by_op["broadcast"] == NB
        assert by_op["all_gather"] == NB and by_op["all_gather_into_tensor"] == NB
        assert by_op["reduce_scatter_tensor"] == NB // 2
        assert by_op["all_to_all_single"] == 1000  # one 250-float row to the other rank
        assert by_op.get("send", 0) == (NB if rank == 0 else 0)
        assert calls.get("recv", 0) == (1 if rank == 1 else 0)
        assert total == sum(by_op.values())
        # The outer counter saw every call too.
        assert res[rank]["outer"] == (total, calls)


def _deepspeed_calls(rank: int, world: int) -> dict:
    import deepspeed
    import deepspeed.comm as ds_dist

    deepspeed.init_distributed(dist_backend="gloo")
    t = torch.ones(1000)
    with WireCounter() as wc:
        ds_dist.all_reduce(t)
        ds_dist.all_gather_into_tensor(torch.empty(world * 1000), t)
        ds_dist.reduce_scatter_tensor(torch.empty(500), torch.ones(1000))
        ds_dist.broadcast(t, src=0)
    after = (ds_dist.comm.cdb.all_gather_function, dist.all_reduce)
    return {"calls": dict(wc.calls), "bytes": wc.bytes_sent, "restored": [getattr(f, "_robust_wire_counter", False) for f in after]}


def test_deepspeed_comm_calls_are_seen():
    pytest.importorskip("deepspeed")
    ext = Path(__file__).resolve().parents[2] / ".venv" / "torch_extensions"
    env = {"DS_ACCELERATOR": "cpu"}
    if "TORCH_EXTENSIONS_DIR" in os.environ or ext.is_dir():
        # Reuse the comm op built at install time (a rebuild costs about a minute, HOSTS.md).
        env["TORCH_EXTENSIONS_DIR"] = os.environ.get("TORCH_EXTENSIONS_DIR", str(ext))
    res = run_ranks(_deepspeed_calls, 2, 150, env=env, init=False)
    for r in res:
        assert r["calls"] == {
            "all_reduce": 1,
            "all_gather_into_tensor": 1,
            "reduce_scatter_tensor": 1,
            "broadcast": 1,
        }
        assert r["bytes"] == NB + NB + NB // 2 + NB
        assert r["restored"] == [False, False]
