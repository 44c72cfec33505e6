"""The elastic agent behind ``robust run``: torchrun's agent plus a fresh worker store per
incarnation and the node monitor.

Why a fresh store (the gloo restart bug, torch 2.13): torchrun's agent hosts one TCPStore for
the whole job and hands its address to every incarnation of the ranks (``MASTER_PORT``,
``TORCHELASTIC_USE_AGENT_STORE=True``). Both the static rendezvous and the c10d one cache that
store across restarts, and ``init_process_group`` writes its keys at fixed names
(``default_pg/0//cpu/rank_N`` and friends). After a restart the new ranks find the *old*
incarnation's gloo addresses already in the store, read them instead of waiting for the new
ones, and ``connectFullMesh`` fails with "Connection refused" (the old ranks are gone). The agent
below starts a new, empty TCPStore on the node of group rank 0 for every incarnation (an OS-chosen
port, announced to the other nodes through the rendezvous store under a per-incarnation key) and
points ``MASTER_ADDR``/``MASTER_PORT`` at it, so no incarnation can read another's keys.
"""

from __future__ import annotations

import os
import time
from typing import Any

from robust_plugins._logging import get_logger
from robust_plugins.watchdog.detect import restart_delay
from robust_plugins.watchdog.monitor import Monitor

log = get_logger(__name__)

#: Rendezvous-store key under which group rank 0 announces the incarnation's worker store.
_STORE_KEY = "robust_run/worker_store/{round}"


def _agent_class():
    # torch.distributed.elastic is imported only when a job is launched. The overrides below rely
    # on private members of torch's agent: refuse a torch whose members moved (patches/torch_elastic.py).
    from robust_plugins.patches import torch_elastic

    torch_elastic.check()
    import torch.distributed as dist
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class RobustAgent(LocalElasticAgent):
        """``LocalElasticAgent`` with a per-incarnation worker store and the watchdog monitor."""

        def __init__(self, *args: Any, monitor: Monitor, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.monitor = monitor
            self._round = 0
            self._worker_store = None
            self._monitor_ok = True

        def _rendezvous(self, worker_group) -> None:
            # Called again for every restart, after the old ranks were stopped: the backoff goes here.
            delay = restart_delay(self.monitor.cfg, self._round)
            if delay > 0:
                log.info("robust run: waiting %.1f s before restart %d (restart_backoff_s)",
                         delay, self._round)
                time.sleep(delay)
            super()._rendezvous(worker_group)
            self._round += 1
            # The c10d (and etcd) rendezvous hand out a store with a fresh prefix every round, so
            # a fixed key is unique per round, also for a node that joins late (its own round
            # count would differ). The static rendezvous reuses one store, but its membership is
            # fixed and every agent re-rendezvouses on every restart: a local count agrees.
            static = worker_group.spec.rdzv_handler.get_backend() == "static"
            key = _STORE_KEY.format(round=self._round if static else "current")
            store = worker_group.store
            if worker_group.group_rank == 0:
                # Dropping the previous incarnation's store stops its server; its ranks are gone.
                self._worker_store = None
                self._worker_store = dist.TCPStore(
                    worker_group.master_addr, 0, is_master=True, wait_for_workers=False,
                )
                store.set(key, f"{worker_group.master_addr}:{self._worker_store.port}".encode())
            addr, _, port = store.get(key).decode().rpartition(":")
            log.info("robust run: incarnation store for round %d at %s:%s (rendezvous store %s:%s)",
                     self._round, addr, port, worker_group.master_addr, worker_group.master_port)
            worker_group.master_addr, worker_group.master_port = addr, int(port)

        def _start_workers(self, worker_group):
            # Start the worker processes with our variables: the elastic subprocess handler
            # copies this process's environment into each rank's.
            os.environ.update(self.monitor.worker_env())
            pids = super()._start_workers(worker_group)
            by_rank = {worker_group.workers[lr].global_rank: pid for lr, pid in pids.items()}
            self.monitor.begin_incarnation(by_rank)
            return pids

        def _monitor_workers(self, worker_group):
            result = super()._monitor_workers(worker_group)
            if not self._monitor_ok:
                return result
            will_restart = self._remaining_restarts > 0
            try:
                if result.state == WorkerState.FAILED:
                    self.monitor.on_crash(result.failures, will_restart)
                elif result.state in (WorkerState.HEALTHY, WorkerState.SUCCEEDED):
                    # Also when every rank exited 0: a NaN, spike or SDC report of the last steps
                    # may still be queued, and the job must then roll back, not end.
                    if self.monitor.check(will_restart) is not None:
                        result = RunResult(state=WorkerState.FAILED)
            except Exception:
                # The watchdog must never take training down with it.
                self._monitor_ok = False
                log.exception("robust run: the watchdog monitor failed; training goes on without "
                              "fault detection (crashes still restart the ranks).")
            return result

    return RobustAgent


def launch(config, entrypoint, args: list[str], monitor: Monitor) -> Any:
    """Run ``entrypoint args`` under the robust agent; returns the agent's ``RunResult``.

    ``config`` is the ``LaunchConfig`` that torchrun's own ``config_from_args`` builds, so every
    torchrun option means what it means there.
    """
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import registry as rdzv_registry
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    params = RendezvousParameters(
        backend=config.rdzv_backend, endpoint=config.rdzv_endpoint, run_id=config.run_id,
        min_nodes=config.min_nodes, max_nodes=config.max_nodes, local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    master_addr, master_port = None, None
    if config.rdzv_backend == "static":
        master_addr, master_port = parse_rendezvous_endpoint(config.rdzv_endpoint, default_port=-1)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    spec = WorkerSpec(
        role=config.role, local_world_size=config.nproc_per_node, entrypoint=entrypoint,
        args=tuple(args), rdzv_handler=rdzv_registry.get_rendezvous_handler(params),
        max_restarts=config.max_restarts, monitor_interval=config.monitor_interval,
        master_addr=master_addr, master_port=master_port, local_addr=config.local_addr,
    )
    agent = _agent_class()(
        spec=spec, logs_specs=config.logs_specs, start_method=config.start_method,
        log_line_prefix_template=config.log_line_prefix_template, monitor=monitor,
    )
    t0 = time.monotonic()
    try:
        result = agent.run()
    finally:
        spec.rdzv_handler.shutdown()
        agent._worker_store = None
    log.info("robust run: agent finished in %.1f s (%s)", time.monotonic() - t0, result.state.name)
    return result
