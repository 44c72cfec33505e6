"""A restart's c10d rendezvous between two nodes on this machine, torch's settings vs robust run's.

Two processes (127.0.0.1 hosts the store, 127.0.0.2 joins) form round 0; then the host starts a
new round, as an agent does after a fault, and the other node notices it through
``num_nodes_waiting()`` (as torch's agent does every monitor interval) and joins. Printed per
trial: how long the other node took to notice, and each node's time in the new round.

    python benchmarks/rdzv_restart.py --trials 3
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import subprocess
import sys
import time


def node(port: int, addr: str, host: bool, robust: bool) -> None:
    from torch.distributed.elastic.rendezvous import RendezvousParameters, registry

    from robust_plugins.patches import torch_elastic

    params = RendezvousParameters(backend="c10d", endpoint=f"127.0.0.1:{port}", run_id="bench",
                                  min_nodes=2, max_nodes=2, local_addr=addr,
                                  is_host="true" if host else "false")
    handler = registry.get_rendezvous_handler(params)
    poll = torch_elastic.rendezvous_poll_s(2)
    if robust:
        torch_elastic.shorten_state_cache(handler, poll)

    def rendezvous() -> float:
        t = time.monotonic()
        with torch_elastic.rendezvous_poll(poll) if robust else contextlib.nullcontext():
            handler.next_rendezvous()
        return time.monotonic() - t

    rendezvous()
    time.sleep(1.0)
    if host:
        print(f"host  new round {rendezvous():.2f} s", flush=True)
    else:
        t = time.monotonic()
        while handler.num_nodes_waiting() == 0:
            time.sleep(0.1)
        noticed = time.monotonic() - t
        print(f"other noticed   {noticed:.2f} s, new round {rendezvous():.2f} s", flush=True)
    time.sleep(1.5)  # the host's store outlives the other node's last read
    handler.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--node", nargs=4, metavar=("PORT", "ADDR", "HOST", "ROBUST"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.node:
        port, addr, host, robust = args.node
        node(int(port), addr, host == "1", robust == "1")
        return
    for robust in (False, True) * args.trials:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, __file__, "--node", str(port)]
        print("robust run's settings (0.1 s poll and cache)" if robust else "torch's settings (1 s)", flush=True)
        host = subprocess.Popen([*cmd, "127.0.0.1", "1", str(int(robust))], stderr=subprocess.DEVNULL)
        time.sleep(0.3)
        subprocess.run([*cmd, "127.0.0.2", "0", str(int(robust))], stderr=subprocess.DEVNULL, timeout=60)
        host.wait(timeout=60)


if __name__ == "__main__":
    main()
