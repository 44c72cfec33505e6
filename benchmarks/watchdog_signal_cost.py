"""What one step signal costs a rank on saturated cores, side by side in one process tree: the
shipped step ring (a record into shared memory) against a datagram a step (the previous design,
still what a rank without a ring sends). The real node ``Monitor`` runs in another process
(receiver thread, and ``check`` every 0.1 s as the agent calls it) and ``loads`` processes busy-loop
so that every core is taken, as on the 2-core benchmark machine with 4 ranks. Each trial is
``steps`` steps of 2 ms busy "compute" followed by ``watchdog.step_end``; the trials alternate
ring, datagram, datagram, ring. Reported per trial: the median, p90 and mean wall time of
``step_end`` and its mean CPU time, and how many steps the monitor saw (all of them, or the
datagrams it dropped)::

    python benchmarks/watchdog_signal_cost.py 3000 2     # steps, load processes
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time


def busy(stop) -> None:
    while not stop.is_set():
        pass


def monitor_proc(run_dir: str, ring: bool, rank_pid: int, conn, stop) -> None:
    from robust_plugins.config import WatchdogConfig
    from robust_plugins.launcher.monitor import Monitor

    mon = Monitor(WatchdogConfig(straggler_factor=0), run_dir, host="b")
    env = mon.worker_env([0] if ring else None)
    mon.begin_incarnation({0: rank_pid})
    conn.send(env)
    while not stop.is_set():
        mon.check(True)
        time.sleep(0.1)
    mon.check(True)
    conn.send({"seen": mon.ranks[0].progress.steps_seen, "missed": mon.transport.ring_missed.get(0, 0)})
    mon.close()


def trial(ring: bool, steps: int, loads: int) -> str:
    import robust_plugins.watchdog.client as c

    with tempfile.TemporaryDirectory() as tmp:
        stop = mp.Event()
        here, there = mp.Pipe()
        mon = mp.Process(target=monitor_proc, args=(tmp, ring, os.getpid(), there, stop))
        mon.start()
        if not here.poll(60):
            raise RuntimeError("the monitor process did not start within 60 s")
        env = here.recv()
        busy_procs = [mp.Process(target=busy, args=(stop,)) for _ in range(loads)]
        for p in busy_procs:
            p.start()
        os.environ.update(env)
        os.environ.update({"ROBUST_RUN_DIR": tmp, "RANK": "0", "ROBUST_INCARNATION": "0"})
        c._client, c._checked = None, False
        walls, cpus = [], []
        try:
            for step in range(1, steps + 1):
                t0 = time.perf_counter()
                while time.perf_counter() - t0 < 0.002:  # 2 ms of "compute"
                    pass
                # process_time() is a system call (a point where the kernel may switch tasks):
                # kept outside the wall-clock interval.
                cp = time.process_time()
                w = time.perf_counter()
                c.step_end(step, loss=1.0, grad_norm=1.0)
                walls.append(time.perf_counter() - w)
                cpus.append(time.process_time() - cp)
            client = c.get_client()
            if (client.ring is not None) != ring:
                raise RuntimeError(f"the rank {'has no' if ring else 'has a'} ring in the "
                                   f"{'ring' if ring else 'datagram'} trial")
            time.sleep(0.3)  # the monitor's next poll
        finally:
            stop.set()
            seen = here.recv() if here.poll(30) else {"seen": None, "missed": None}
            mon.join(10)
            for p in busy_procs:
                p.join(10)
            client = c.get_client()
            if client is not None:
                if client.ring is not None:
                    client.ring.close()
                client.sock.close()
        walls.sort()
        name = "ring (shipped)" if ring else "datagram a step (previous design)"
        return (f"{name}: step_end median {statistics.median(walls) * 1e6:.1f} us, p90 "
                f"{walls[int(0.9 * len(walls))] * 1e6:.1f} us, mean {statistics.mean(walls) * 1e6:.1f} us "
                f"wall; CPU mean {statistics.mean(cpus) * 1e6:.1f} us; monitor saw {seen['seen']} of "
                f"{steps} steps ({seen['missed']} counted overwritten)")


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    loads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    for ring in (True, False, False, True):
        print(trial(ring, steps, loads), flush=True)


if __name__ == "__main__":
    main()
