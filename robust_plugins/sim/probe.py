"""Rank program that measures a simulated cluster's links: ``python -m robust_plugins.sim.probe``.

Run once per rank (by :meth:`robust_plugins.sim.SimCluster.run`). Rank 0 sends ``--mbytes`` MB to
the first rank of its own node (intra-node, loopback) and to the first rank of node 1 (inter-node,
crossing the rate-limited links), after one small warm-up message each, and prints one JSON line:
``{"intra_bits_per_s": ..., "inter_bits_per_s": ..., "bytes": ...}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import torch
import torch.distributed as dist


def _timed_send(peer: int, payload: torch.Tensor) -> float:
    dist.send(payload[:1024], dst=peer)  # warm-up: the gloo pair connection is made lazily
    ack = torch.zeros(1)
    dist.recv(ack, src=peer)
    start = time.perf_counter()
    dist.send(payload, dst=peer)
    dist.recv(ack, src=peer)  # the peer acks once all bytes arrived
    return time.perf_counter() - start


def _timed_recv(peer: int, payload: torch.Tensor) -> None:
    ack = torch.zeros(1)
    dist.recv(payload[:1024], src=peer)
    dist.send(ack, dst=peer)
    dist.recv(payload, src=peer)
    dist.send(ack, dst=peer)


def main() -> int:
    """Measure and print (rank 0); every other rank takes part or waits at the barrier."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mbytes", type=float, default=4.0)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, per_node = dist.get_rank(), int(os.environ["LOCAL_WORLD_SIZE"])
    payload = torch.zeros(int(args.mbytes * 1e6) // 4, dtype=torch.float32)
    intra_peer, inter_peer = (1 if per_node > 1 else None), (per_node if dist.get_world_size() > per_node else None)
    result = {"bytes": payload.numel() * 4}
    for name, peer in (("intra", intra_peer), ("inter", inter_peer)):
        if peer is None:
            continue
        if rank == 0:
            result[f"{name}_bits_per_s"] = payload.numel() * 4 * 8 / _timed_send(peer, payload)
        elif rank == peer:
            _timed_recv(0, payload)
    dist.barrier()
    if rank == 0:
        print(json.dumps(result), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
