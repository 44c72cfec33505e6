"""The compressed all-reduce cut into pieces (``collectives.PIECE_NUMEL``) computes the same bits.

A chunk longer than ``PIECE_NUMEL`` is encoded, sent, reduced and gathered piece by piece, with
piece ``p`` on the wire while ``p + 1`` is encoded. The pieces are whole blocks, so results and
both error-feedback residuals must equal the one-piece schedule bit for bit, for every codec,
with padding (a rank whose chunk ends in padding, pieces that are padding only), a NaN, other
float dtypes and through the hierarchical all-reduce. The call counts prove the pieces ran, and a timing
WireCounter still counts the waits for the asynchronous pieces as time in communication.
One launch of 4 ranks (a simulated 2 x 2 layout) runs every scenario; the tests assert on it.
"""

from __future__ import annotations

import functools
import time

import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks
from robust_plugins.comm import CompressionState, WireCounter, _twophase, collectives, compressed_all_reduce
from robust_plugins.topology import build_groups, discover, hierarchical_all_reduce

pytestmark = pytest.mark.distributed

WORLD = 4
N = 10_007  # block 64, 4 ranks: chunk 2560; rank 3 holds 2327 real elements, then padding
BLOCK = 64
PIECE = 3 * BLOCK + 5  # not whole blocks: rounded down to 3 blocks, 14 pieces a chunk
CODECS = ("bf16", "int8", "int4", "sign")
LATE_S = 1.0


def rank_input(rank: int, n: int = N, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(700 + rank)
    return (torch.randn(n, generator=g) * (rank + 1)).to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).clone()


def _run(piece: int, rank: int, groups) -> dict:
    """Every scenario with ``PIECE_NUMEL = piece``; results as raw bytes."""
    collectives.PIECE_NUMEL = piece
    out: dict = {"calls": {}, "bytes": {}}
    for codec in CODECS:
        st = CompressionState(codec=codec, block_size=BLOCK)
        steps = []
        for step in range(2):  # the second step starts from the first one's residuals
            x = rank_input(rank + 10 * step)
            if step == 1 and rank == 1:
                x[700] = float("nan")
            with WireCounter() as wc:
                steps.append(_bits(compressed_all_reduce(x, state=st, key="k")))
        out[codec] = steps
        out[codec + " residuals"] = [_bits(st.sender_residual("k", N)),
                                     _bits(st.server_residual("k", _twophase.plan(N, WORLD, codec, BLOCK).chunk))]
        out["calls"][codec] = dict(wc.calls)
        out["bytes"][codec] = wc.bytes_sent
    out["bf16 tensor"] = _bits(compressed_all_reduce(rank_input(rank, 6 * 331, torch.bfloat16).view(6, 331),
                                                     codec="int8", op="sum", block_size=BLOCK))
    hst = CompressionState(codec="int8", block_size=BLOCK)
    for n in (N + 1, N):  # divisible by the node size (reduced in place) and not (staged)
        x = rank_input(rank, n)
        with WireCounter(filter_group=groups.rail) as wc:
            hierarchical_all_reduce(x, groups, state=hst, key=n)
        out[f"hier {n}"] = _bits(x)
        out["calls"][f"hier {n}"] = dict(wc.calls)
    return out


def _scenarios(rank: int, world: int) -> dict:
    groups = build_groups(discover().records)
    one_piece = _run(1 << 30, rank, groups)
    pieces = _run(PIECE, rank, groups)
    # Rank 0 starts late: the others wait inside the pipelined collectives (async launches, then
    # waits), and a timing WireCounter (the straggler detector's) must count that wait.
    x = rank_input(rank)
    dist.barrier()
    with WireCounter(timing_only=True) as wc:
        if rank == 0:
            time.sleep(LATE_S)
        compressed_all_reduce(x, codec="int8")
    dist.barrier()
    return {"one piece": one_piece, "pieces": pieces, "comm seconds": wc.seconds}


@functools.lru_cache(maxsize=None)
def _results() -> list[dict]:
    return run_ranks(_scenarios, WORLD, 90, env={"ROBUST_TOPOLOGY_SIM": "2x2"})


def test_pieces_are_whole_blocks_covering_the_chunk():
    layout = _twophase.plan(N, WORLD, "int4", BLOCK)
    got = _twophase.pieces(layout, PIECE)
    assert [length for _, length in got] == [3 * BLOCK] * 13 + [BLOCK]
    assert [start for start, _ in got] == [i * 3 * BLOCK for i in range(14)]
    assert _twophase.pieces(layout, 1) == [(i * BLOCK, BLOCK) for i in range(layout.chunk // BLOCK)]
    assert _twophase.pieces(layout, 1 << 30) == [(0, layout.chunk)]


def test_pieces_give_the_same_bits_as_one_piece():
    for rank, res in enumerate(_results()):
        one, many = res["one piece"], res["pieces"]
        keys = [k for k in one if k not in ("calls", "bytes")]
        assert len(keys) == 2 * len(CODECS) + 3
        for key in keys:
            a, b = one[key], many[key]
            if isinstance(a, list):
                for i, (x, y) in enumerate(zip(a, b, strict=True)):
                    assert torch.equal(x, y), f"rank {rank}: {key}[{i}] differs between the schedules"
            else:
                assert torch.equal(a, b), f"rank {rank}: {key} differs between the schedules"
        # The NaN on rank 1 (step 2) reached every rank as a NaN block, in both schedules.
        nan_block = many["int8"][1].view(torch.float32)[640:704]
        assert torch.isnan(nan_block).all()


def test_pieces_ran_as_separate_collectives_with_the_same_bytes():
    res = _results()[0]
    one, many = res["one piece"], res["pieces"]
    for codec in CODECS:
        assert one["calls"][codec] == {"all_to_all_single": 1, "all_gather_into_tensor": 1}
        assert many["calls"][codec] == {"all_to_all_single": 14, "all_gather_into_tensor": 14}, codec
        assert many["bytes"][codec] == one["bytes"][codec], codec
    # Hierarchical: the rail step (2 ranks) carries a shard of ceil(n / 2) elements: chunk 2560.
    for n in (N + 1, N):
        assert one["calls"][f"hier {n}"] == {"all_to_all_single": 1, "all_gather_into_tensor": 1}
        assert many["calls"][f"hier {n}"] == {"all_to_all_single": 14, "all_gather_into_tensor": 14}


def test_waits_inside_the_pipeline_count_as_communication():
    res = _results()
    # Launching 14 + 14 asynchronous calls takes milliseconds; the ranks that waited for rank 0
    # spent most of its LATE_S in work.wait(), which the counter must see.
    for rank in range(1, WORLD):
        assert res[rank]["comm seconds"] > 0.5 * LATE_S, (rank, res[rank]["comm seconds"])
