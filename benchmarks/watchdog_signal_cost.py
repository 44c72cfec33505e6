"""step_end cost on a rank, with the real node Monitor in another process and 2 busy-looping
processes as load: the monitor's receiver thread as shipped (a normal thread) vs SCHED_BATCH (an experiment).

    python benchmarks/watchdog_signal_cost.py 3000 2     # steps, load processes
"""
import json, multiprocessing as mp, os, statistics, sys, tempfile, threading, time

def busy(stop):
    while not stop.is_set():
        pass

def monitor_proc(run_dir, batch, ready, stop):
    from robust_plugins.config import WatchdogConfig
    from robust_plugins.watchdog.monitor import Monitor
    if batch:
        shipped = Monitor._receive

        def batch_receive(self):
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
            shipped(self)

        Monitor._receive = batch_receive
    mon = Monitor(WatchdogConfig(straggler_factor=0), run_dir, host="b")
    mon.begin_incarnation({0: os.getppid()})
    ready.set()
    while not stop.is_set():
        mon.check(True)
        time.sleep(0.1)
    mon.close()

def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    loads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    for batch in (False, True, False, True):
        with tempfile.TemporaryDirectory() as tmp:
            ready, stop = mp.Event(), mp.Event()
            p = mp.Process(target=monitor_proc, args=(tmp, batch, ready, stop)); p.start(); ready.wait(30)
            ls = [mp.Process(target=busy, args=(stop,)) for _ in range(loads)]
            [l.start() for l in ls]
            os.environ.update({"ROBUST_WATCHDOG_SOCKET": os.path.join(tmp, "monitor.sock"), "ROBUST_RUN_DIR": tmp, "RANK": "0", "ROBUST_INCARNATION": "0", "ROBUST_STRAGGLER": "0"})
            import robust_plugins.watchdog.client as c
            c._client = None; c._checked = False
            walls, cpus = [], []
            for step in range(1, n + 1):
                t0 = time.perf_counter(); x = 0
                while time.perf_counter() - t0 < 0.002: x += 1   # 2 ms of "compute"
                w, cp = time.perf_counter(), time.process_time()
                c.step_end(step, loss=1.0, grad_norm=1.0)
                walls.append(time.perf_counter() - w); cpus.append(time.process_time() - cp)
            stop.set(); p.join(10); [l.join(10) for l in ls]
            walls.sort()
            print(f"receiver {'SCHED_BATCH (experiment, not shipped)' if batch else 'SCHED_OTHER (shipped)'}: step_end median {statistics.median(walls)*1e6:.1f} us, p90 {walls[int(0.9*len(walls))]*1e6:.1f} us, mean {statistics.mean(walls)*1e6:.1f} us wall; CPU mean {statistics.mean(cpus)*1e6:.1f} us", flush=True)

if __name__ == "__main__":
    main()
