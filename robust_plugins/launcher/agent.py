"""The elastic agent behind ``robust run``: torchrun's agent plus a fresh worker store per
incarnation and the node monitor. It imports torch.distributed.elastic; ``robust run`` imports
it when a job starts (``cli/run.py``), no other command does.

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

Warm restarts (on unless ``--no-standby``): the agent keeps one standby interpreter per local
rank (:mod:`.standby.pool`), started once the ranks train; on a restart it kills
the old ranks at once (SIGKILL: their state is in shared-memory snapshots and atomically written
checkpoints, so a grace period buys nothing) and hands each rank to a standby instead of starting
a fresh ``python``. Every restart's ``detail.restart_s`` and ``detail.standby`` go to faults.jsonl.

Multi-node jobs with the c10d rendezvous also keep a job-wide fault view: every agent sends its
node's faults.jsonl lines, tagged with a job-wide round number, to the rendezvous store and writes
every node's, merged so that one fault appears once (:mod:`.jobfaults`), to ``job_faults.jsonl``.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import RunResult, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from robust_plugins._logging import get_logger
from robust_plugins.errors import ConfigError, RobustPluginsError
from robust_plugins.watchdog import completion
from robust_plugins.watchdog.detect import restart_delay
from robust_plugins.launcher.jobfaults_sync import STORE_TIMEOUT_S, JobFaultView
from robust_plugins.launcher.monitor import Monitor
from robust_plugins.launcher.nodes import (NodeExcluded, NodeRegistry, exchange_hang_views, exiting_ranks,
                                           node_blame)
from robust_plugins.watchdog.protocol import ENV_LAUNCH_WORLD
from robust_plugins.launcher.standby.pool import StandbyPool, target_of
from robust_plugins.patches import torch_elastic

log = get_logger(__name__)

#: When this launcher started: completion records older than it are an earlier launch's.
_LAUNCHED = time.time()

#: Rendezvous-store key under which group rank 0 announces the incarnation's worker store.
_STORE_KEY = "robust_run/worker_store/{round}"

#: Job-wide counter of rendezvous rounds (group rank 0 adds 1 a round) and the per-round key
#: announcing its value: every node's faults of one round carry the same number in the
#: job-wide fault view, whatever this node's own round count (a spare joins late).
_JOB_ROUNDS = "robust_run/job_rounds"
_JOB_ROUND_KEY = "robust_run/job_round/current"

#: Raw rendezvous-store key group rank 0 sets once the job's first round formed: a ``--spare``
#: node waits for it, so it joins torch's redundancy list (beyond ``--nnodes`` MAX) and never
#: one of the first rounds' participants.
STARTED_KEY = "robust_run/{run_id}/started"


class RobustAgent(LocalElasticAgent):
    """``LocalElasticAgent`` with a per-incarnation worker store, the node monitor (``monitor``:
    checked every monitor interval, told of every start), warm standbys (``standby``) and, with a
    ``registry``, node blames and exclusion. Every private member of torch's agent it overrides or
    reads is checked by :func:`robust_plugins.patches.torch_elastic.check` when it is built."""

    def __init__(self, *args: Any, monitor: Monitor, node: str,
                 registry: NodeRegistry | None = None, standby: bool = True, rdzv_poll_s: float = 1.0,
                 **kwargs: Any) -> None:
        # The overrides below rely on private members of torch's agent: refuse a torch whose
        # members moved (HostVersionError naming them) before anything starts.
        torch_elastic.check()
        super().__init__(*args, **kwargs)
        self.rdzv_poll_s = rdzv_poll_s
        self.pool: StandbyPool | None = None
        self._our_env: set[str] | None = None
        self._served: list[int] = []
        self._standby_ready_s: list[float] = []
        if standby:
            spec = self._worker_group.spec
            target, why = target_of(spec.entrypoint, spec.args)
            if target is None:
                log.warning("robust run: no standby workers: %s; restarts start cold.", why)
            else:
                self.pool = StandbyPool(spec.local_world_size, target, monitor.run_dir,
                                        per_rank=self._per_rank_env)
        self.monitor = monitor
        self.node = node
        self.registry = registry
        self._round = 0
        self._worker_store = None
        self._monitor_ok = True
        self._launch_world: int | None = None
        self._world: int | None = None
        self.job_store = None  # the raw rendezvous store (c10d with an endpoint), set by launch()
        self.view: JobFaultView | None = None  # the job-wide fault view, set by launch()
        self._hold_until: float | None = None  # see _hold_for_peer

    def _refuse_if_excluded(self) -> None:
        # Before joining: a node that joined and then left would make every other node's
        # ranks of the new round fail to form their process group.
        if self.registry is None:
            return
        self._report_exclusions()
        record = self.registry.excluded()
        if record is not None:
            raise NodeExcluded(record)

    def _report_exclusions(self) -> None:
        # Read the job's exclusion list into this node's excluded_nodes.json and say what is new.
        try:
            new = self.registry.refresh()
        except Exception:
            new = []  # said by excluded(); the rendezvous reports the unreachable store
        for rec in new:
            if rec["node"] != self.node:
                print(f"robust run: node {rec['node']} is EXCLUDED from this job (blamed "
                      f"{rec['blames']} times; last: {rec['reason']}); the job continues "
                      f"without it. See {self.registry.path}", flush=True)

    def _note_membership(self, worker_group) -> None:
        # torch's dynamic rendezvous already admits any node count within --nnodes MIN:MAX and
        # drops a node whose keep-alive expired: we only record the result and say what changed.
        world = worker_group.workers[0].world_size if worker_group.workers else 0
        if self._launch_world is None:
            self._launch_world = world
        rec = {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"),
               "round": self._round, "node": self.node, "group_rank": worker_group.group_rank,
               "nodes": worker_group.group_world_size, "world_size": world,
               "launch_world_size": self._launch_world}
        with open(self.monitor.run_dir / "membership.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        if self._world is not None and world != self._world and self.registry is not None:
            # The node that left may have been excluded after this node last looked (it records
            # its second blame while this one already rejoins): read the list again now.
            self._report_exclusions()
        if self._world is not None and world != self._world:
            msg = (f"robust run: the job continues on {worker_group.group_world_size} node(s), "
                   f"{world} ranks (was {self._world}); scripts that size gradient accumulation "
                   f"with robust_plugins.watchdog.grad_accumulation(global_batch, micro_batch) "
                   f"keep the global batch (rank 0 prints the new accumulation)")
            log.warning("%s", msg)
        self._world = world

    def _blame(self, fault) -> None:
        if fault is not None and fault.kind == "hang":
            self._judge_hang_jobwide(fault)
            # Read before any blame or hold: a suspect caught exiting is no evidence (nodes.py).
            exiting = exiting_ranks(fault.suspect_ranks, fault.evidence)
            if exiting:
                fault.detail["exiting"] = exiting
        if self.registry is None or fault is None or not self._worker_group.workers:
            return
        local = {w.global_rank for w in self._worker_group.workers}
        reason = node_blame(fault, local)
        fault.detail["node_blamed"] = reason is not None
        if reason is None:
            if fault.kind == "crash":
                fault.detail["reason"] = (
                    f"{fault.detail.get('reason', '')}; not blamed on node {self.node}: a plain "
                    f"non-zero exit is also how a rank ends whose peer on another node died")
            return
        try:
            record = self.registry.blame(fault, reason)
        except Exception:
            # The store is gone (its host node died): this agent's round ends anyway.
            log.exception("robust run: could not count a blame against node %s in the "
                          "rendezvous store", self.node)
            return
        if record is not None:
            print(f"robust run: node {self.node} reached {record['blames']} blames and is "
                  f"excluded from the job ({self.registry.path})", flush=True)

    def _judge_hang_jobwide(self, fault) -> None:
        # A multi-node job: every node's flight-recorder views, so that a group is judged over
        # all its members (nodes.exchange_hang_views); one node's view alone compares only its
        # own ranks, and on NCCL its waiting ranks look stuck to their stacks.
        workers = self._worker_group.workers
        store = self._worker_group.store
        views = fault.detail.get("flight_recorder") or {}
        if not workers or store is None or workers[0].world_size <= len(workers):
            return
        if not any(views.values()):
            return  # no flight recorder here (gloo: stacks decide; NCCL without a server)
        payload = {"ranks": [w.global_rank for w in workers], "views": views}
        entries = exchange_hang_views(store, str(self._round), self.node, payload,
                                      self._worker_group.group_world_size,
                                      self.monitor.cfg.stack_dump_timeout_s)
        try:
            self.monitor.rejudge_hang(fault, entries)
        except Exception:  # the local verdict stands; its blame rule is as strict
            log.exception("robust run: the job-wide hang verdict failed; judging on this node's view")

    def _rendezvous(self, worker_group) -> None:
        self._refuse_if_excluded()
        # Called again for every restart, after the old ranks were stopped: the backoff goes here.
        delay = restart_delay(self.monitor.cfg, self._round)
        if delay > 0:
            log.info("robust run: waiting %.1f s before restart %d (restart_backoff_s)",
                     delay, self._round)
            time.sleep(delay)
        # per_round_bootstrap: nodes that join later rounds (spares) get the round's address.
        with torch_elastic.per_round_bootstrap(), torch_elastic.rendezvous_poll(self.rdzv_poll_s):
            super()._rendezvous(worker_group)
        self._round += 1
        # The c10d (and etcd) rendezvous hand out a store with a fresh prefix every round, so
        # a fixed key is unique per round, also for a node that joins late (its own round
        # count would differ). The static rendezvous reuses one store, but its membership is
        # fixed and every agent re-rendezvouses on every restart: a local count agrees.
        static = worker_group.spec.rdzv_handler.get_backend() == "static"
        key = _STORE_KEY.format(round=self._round if static else "current")
        store = worker_group.store
        if worker_group.group_rank == 0 and self.job_store is not None:
            # Before the worker store's key: a node that read that one finds this one set.
            store.set(_JOB_ROUND_KEY, str(int(self.job_store.add(_JOB_ROUNDS, 1))).encode())
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
        self._note_membership(worker_group)
        if self.view is not None:
            self.view.join_round(int(store.get(_JOB_ROUND_KEY)), self.monitor.incarnation + 1,
                                 worker_group.group_world_size,
                                 [w.global_rank for w in worker_group.workers])
        if worker_group.group_rank == 0 and self.job_store is not None:
            self.job_store.set(STARTED_KEY.format(run_id=worker_group.spec.rdzv_handler.get_run_id()), b"1")

    def _per_rank_env(self, name: str) -> bool:
        # What may differ between a standby's import environment and its rank's: torch's
        # per-rank variables and ours (set below for every incarnation).
        if self._our_env is None:
            self._our_env = {*self.monitor.worker_env(), ENV_LAUNCH_WORLD}
        return torch_elastic.is_rank_env(name) or name in self._our_env

    def _start_workers(self, worker_group):
        # Start the worker processes with our variables: the elastic subprocess handler
        # copies this process's environment into each rank's. The monitor also creates the
        # step rings of the global ranks about to start here.
        os.environ.update(self.monitor.worker_env(w.global_rank for w in worker_group.workers))
        os.environ[ENV_LAUNCH_WORLD] = str(self._launch_world or "")
        self._served = []
        self._hold_until = None
        first = self.monitor.incarnation < 0
        if self.pool is not None and first and self.pool.fork:
            # The first incarnation too comes from the node's fork server: one import a node
            # instead of one a rank (the ranks' own imports are what a cold start waits on).
            self.pool.tick(spawn=True)
        if self.pool is not None and (not first or self.pool.standbys):
            with torch_elastic.subprocess_handlers(self._from_standby):
                pids = super()._start_workers(worker_group)
        else:
            pids = super()._start_workers(worker_group)
        by_rank = {worker_group.workers[lr].global_rank: pid for lr, pid in pids.items()}
        self.monitor.note_restart(self._served, len(by_rank))
        self.monitor.begin_incarnation(by_rank)
        return pids

    def _from_standby(self, entrypoint, args, env, stdout, stderr, local_rank_id,
                      numa_options=None):
        # torch's per-rank process factory during a restart: a standby's process, or None
        # (torch starts the rank cold; each reason is logged by the pool or here).
        target, why = target_of(entrypoint, args)
        if target is None or numa_options is not None:
            log.warning("robust run: rank %s starts cold: %s", env.get("RANK"),
                        why or "NUMA binding wraps the command (numactl)")
            return None
        # An importing standby started before a fresh process would: wait for it up to twice
        # the time standbys took to get ready so far (60 s before any was). The first
        # incarnation's were asked for just now: their import is the start-up itself.
        typical = sorted(self._standby_ready_s)[len(self._standby_ready_s) // 2] if self._standby_ready_s else 30.0
        wait = self.pool.ready_timeout_s if self.monitor.incarnation < 0 else 2 * typical
        sb = self.pool.take(wait_s=wait)
        if sb is None:
            log.info("robust run: no standby ready for rank %s; it starts cold", env.get("RANK"))
            return None
        full = os.environ.copy()
        full.update(env)  # what torch's SubprocessHandler gives a rank it starts itself
        if not self.pool.hand(sb, target, full, stdout or None, stderr or None, env["RANK"]):
            return None
        self._served.append(int(env["RANK"]))
        return torch_elastic.StandbyHandler(sb.proc, local_rank_id)

    def _stop_workers(self, worker_group) -> None:
        if self.pool is None:
            return super()._stop_workers(worker_group)
        self._shutdown(death_sig=signal.SIGKILL, timeout=5)

    def _tick_standbys(self) -> None:
        # On the agent's main thread (PR_SET_PDEATHSIG follows the spawning thread); the
        # standbys import while the ranks train, never while they start up.
        if self.pool is None:
            return
        stepping = any(st.progress.last_step is not None for st in self.monitor.ranks.values())
        spawn = stepping and self._remaining_restarts > 0  # no restart left: nothing to serve
        before = {id(sb) for sb in self.pool.standbys if sb.ready is not None}
        self.pool.tick(spawn=spawn)
        for sb in self.pool.standbys:
            if sb.ready is not None and id(sb) not in before:
                self._standby_ready_s.append(time.monotonic() - sb.spawned)

    def _monitor_workers(self, worker_group):
        # torch's poll stops the other ranks (SIGTERM, up to its grace) as soon as one has
        # failed, before it returns: time the detection to the poll's start, not its end.
        seen = (time.time(), time.monotonic())
        # ... and that stop would kill a survivor whose emergency save has not started yet.
        with torch_elastic.before_failure_stop(self, self._hold_for_saves):
            result = super()._monitor_workers(worker_group)
        try:
            self._tick_standbys()
        except Exception:
            # Standbys only make restarts faster: without them restarts start cold.
            log.exception("robust run: the standby pool failed; restarts start cold.")
            self.pool, pool = None, self.pool
            pool.close()
        if result.state == WorkerState.FAILED:
            done = completion.job_completed(str(self.monitor.run_dir), [w.global_rank for w in worker_group.workers],
                                            worker_group.workers[0].world_size, _LAUNCHED)
            if done is not None:  # e.g. exit -6 at interpreter exit: never train again
                codes = {r: getattr(f, "exitcode", None) for r, f in (result.failures or {}).items()}
                print(completion.verdict(done, codes), file=sys.stderr, flush=True)
                log.warning("%s", completion.verdict(done, codes))
                return RunResult(state=WorkerState.SUCCEEDED,
                                 return_values={w.global_rank: None for w in worker_group.workers})
        if not self._monitor_ok:
            return result
        if self._hold_until is not None:
            return self._held(result)
        will_restart = self._remaining_restarts > 0
        try:
            fault = None
            if result.state == WorkerState.FAILED:
                # A NaN, spike or SDC the ranks reported before they exited comes back instead
                # of the crash: its rollback bound holds for the restart.
                fault = self.monitor.on_crash(result.failures, will_restart, seen=seen)
                self._blame(fault)
            elif result.state in (WorkerState.HEALTHY, WorkerState.SUCCEEDED):
                # Also when every rank exited 0: a NaN, spike or SDC report of the last steps
                # may still be queued, and the job must then roll back, not end.
                fault = self.monitor.check(will_restart)
                if fault is not None:
                    self._blame(fault)
                    if self._hold_for_peer(fault):
                        return result
                    result = RunResult(state=WorkerState.FAILED)
            if fault is not None and fault.detail.get("refused"):
                self._remaining_restarts = 0  # refused before its first step: final (monitor.on_crash)
            if fault is not None and fault.action == "evict" and self.registry is None:
                # A persistent SDC on a single-node job: every restart would corrupt the same
                # step again. (Multi-node: the node's blames exclude it.)
                self._remaining_restarts = 0
        except Exception:
            self._monitor_failed()
        return result

    def _hold_for_saves(self) -> None:
        if not self._monitor_ok:
            return
        try:
            self.monitor.hold_for_emergency_saves()
        except Exception:
            self._monitor_failed()  # and torch's stop goes ahead

    def _monitor_failed(self) -> None:
        # The watchdog must never take training down with it.
        self._monitor_ok = False
        log.exception("robust run: the watchdog monitor failed; training goes on without "
                      "fault detection (crashes still restart the ranks).")

    def _hold_for_peer(self, fault) -> bool:
        # A hang whose suspects on this node all wait inside a collective waits for a peer on
        # another node. That node's monitor sees its stuck rank about when this one saw the
        # waiting ranks (both timeouts are learned from the same lockstep steps, and the stuck
        # rank stalled a step earlier), then reads stacks for at most stack_dump_timeout_s
        # (15 s). Were this node to stop its ranks first, that node would see only a peer's
        # exit 1 and never record the hang it has the evidence for, and the job-wide view would
        # name this node. So the restart waits that long, or until the ranks here fail (the
        # other node restarted) or a node waits in the rendezvous (torch restarts then).
        workers = self._worker_group.workers
        if fault.kind != "hang" or not workers or workers[0].world_size <= len(workers):
            return False
        if node_blame(fault, {w.global_rank for w in workers}) is not None:
            return False
        hold = self.monitor.cfg.stack_dump_timeout_s
        log.warning("robust run: rank(s) %s wait inside a collective for a peer on another node (suspects "
                    "%s); this node restarts in %.0f s unless that node restarts first",
                    sorted(w.global_rank for w in workers), fault.suspect_ranks, hold)
        self._hold_until = time.monotonic() + hold
        return True

    def _held(self, result):
        # The hang is recorded: its ranks' exits when the other node restarts are its side
        # effect, not a fault of their own.
        if result.state == WorkerState.FAILED or time.monotonic() >= self._hold_until:
            self._hold_until = None
            return RunResult(state=WorkerState.FAILED)
        return result


def launch(config, entrypoint, args: list[str], monitor: Monitor, standby: bool = True,
           spare: bool = False) -> Any:
    """Run ``entrypoint args`` under the robust agent; returns the agent's ``RunResult``, or None
    for a ``spare`` node the job ended without.

    ``config`` is the ``LaunchConfig`` that torchrun's own ``config_from_args`` builds, so every
    torchrun option means what it means there. ``standby``: keep warm standby workers.
    ``spare``: a hot spare node (:func:`check_spare`): it waits until the job runs, then joins
    torch's redundancy list and replaces the first node the job loses or excludes.
    """
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
    poll_s = torch_elastic.rendezvous_poll_s(config.max_nodes)
    torch_elastic.shorten_state_cache(spec.rdzv_handler, poll_s)
    node = config.local_addr or monitor.host
    registry = _node_registry(config, node, monitor)
    agent = RobustAgent(
        spec=spec, logs_specs=config.logs_specs, start_method=config.start_method,
        log_line_prefix_template=config.log_line_prefix_template, monitor=monitor, node=node,
        registry=registry, standby=standby, rdzv_poll_s=poll_s,
    )
    agent.job_store = registry.store if registry is not None else _job_store(config)
    if spare:
        _wait_for_the_job(config, agent.job_store)
    agent.view = _job_fault_view(config, node, monitor, agent.job_store)
    t0 = time.monotonic()
    excluded = False
    result = None
    try:
        if agent.view is not None:
            agent.view.start()
        result = agent.run()
    except NodeExcluded:
        excluded = True
        raise
    except RendezvousConnectionError:
        if not spare or agent._round > 0:
            raise
        # A waiting spare polls the store the job's host node serves: when the job ends, that
        # node exits, often before the spare saw the rendezvous closed. Either way (the job
        # ended, or its store's host was lost, which no spare can replace) it has nothing to do.
        print(f"robust run: the rendezvous store at {config.rdzv_endpoint} went away while this "
              f"spare waited: the job ended (or lost the node hosting its store, which a spare "
              f"cannot replace); the spare exits.", flush=True)
        result = None
    finally:
        # shutdown() *closes* the rendezvous for every node (torchrun's way to end a job); an
        # excluded node only leaves: the others drop it when its keep-alive expires. So does a
        # spare that never joined (stopped by its user, or the job is over).
        if not excluded and not (spare and agent._round == 0):
            spec.rdzv_handler.shutdown()
        agent._worker_store = None
        if agent.pool is not None:
            agent.pool.close()
        if agent.view is not None:
            # The faults held for a resume step go out with this node's last records.
            monitor.flush_faults()
            agent.view.close(completed=result is not None and not result.is_failed())
    if result is None:
        # torch's agent returns nothing when the rendezvous closed while this node waited in its
        # redundancy list: the job finished (or failed) without needing it.
        log.info("robust run: agent left the closed rendezvous after %.1f s", time.monotonic() - t0)
        return None
    log.info("robust run: agent finished in %.1f s (%s)", time.monotonic() - t0, result.state.name)
    return result


def check_spare(config) -> None:
    """Refuse ``--spare`` where a spare cannot work: it needs the c10d rendezvous (whose
    redundancy list holds nodes beyond MAX without restarting the job) at an explicit endpoint
    hosted by another node."""
    endpoint = config.rdzv_endpoint or ""
    if config.rdzv_backend != "c10d" or not endpoint or endpoint.endswith(":0"):
        raise ConfigError(
            f"--spare needs --rdzv-backend c10d with the job's --rdzv-endpoint HOST:PORT (got "
            f"backend {config.rdzv_backend!r}, endpoint {endpoint!r}); --standalone jobs have no spares.")
    if str(config.rdzv_configs.get("is_host", "")).lower() in ("1", "true", "yes"):
        raise ConfigError("--spare with --rdzv-conf is_host=true: a spare must not host the "
                          "rendezvous store (the job could not outlive it); drop is_host on the spare.")
    if config.max_nodes <= 1:
        raise ConfigError(f"--spare needs a multi-node job (--nnodes MIN:MAX with MAX > 1); got MAX "
                          f"{config.max_nodes}.")


def _job_store(config):
    # A client of the c10d rendezvous's own store (no prefix): where group rank 0 says the job
    # started. None for other backends: no spare can wait on them (check_spare refuses).
    if config.rdzv_backend != "c10d" or not config.rdzv_endpoint or config.rdzv_endpoint.endswith(":0"):
        return None
    host, port = parse_rendezvous_endpoint(config.rdzv_endpoint, default_port=29400)
    timeout = datetime.timedelta(seconds=float(config.rdzv_configs.get("read_timeout", 60)))
    return dist.TCPStore(host, port, is_master=False, timeout=timeout)


def _wait_for_the_job(config, store) -> None:
    # Bounded by the rendezvous's join timeout, as any node's first rendezvous is.
    timeout_s = float(config.rdzv_configs.get("join_timeout", 600))
    key = STARTED_KEY.format(run_id=config.run_id)
    print(f"robust run: hot spare for job {config.run_id!r}: waiting up to {timeout_s:.0f} s for it "
          f"to start, then standing by to replace the first node it loses", flush=True)
    try:
        store.wait([key], datetime.timedelta(seconds=timeout_s))
    except Exception as exc:  # torch raises DistStoreError (a RuntimeError) on timeout
        raise RobustPluginsError(
            f"robust run --spare: job {config.run_id!r} did not start within {timeout_s:.0f} s "
            f"(rendezvous join_timeout) at {config.rdzv_endpoint} ({exc}); start the spare after "
            f"(or with) the job's nodes, with the same --rdzv-id and --rdzv-endpoint.") from exc
    print(f"robust run: job {config.run_id!r} is running; this spare joins when it loses a node", flush=True)


def _job_fault_view(config, node: str, monitor: Monitor, job_store) -> JobFaultView | None:
    """The job-wide fault view (:mod:`.jobfaults_sync`) of a multi-node job whose agents share the
    c10d rendezvous store; None for a single node (its faults.jsonl is the job's), said otherwise."""
    if config.max_nodes <= 1:
        return None
    if job_store is None:
        print(f"robust run: no job-wide fault view with --rdzv-backend {config.rdzv_backend} and "
              f"endpoint {config.rdzv_endpoint!r}: telemetry, reports and W&B see only this node's "
              f"faults.jsonl. Use --rdzv-backend c10d with --rdzv-endpoint HOST:PORT.", flush=True)
        return None
    host, port = parse_rendezvous_endpoint(config.rdzv_endpoint, default_port=29400)
    timeout = datetime.timedelta(seconds=STORE_TIMEOUT_S)
    return JobFaultView(lambda: dist.TCPStore(host, port, is_master=False, timeout=timeout), node, monitor)


def _node_registry(config, node: str, monitor: Monitor):
    """Blame counts in the job's rendezvous store (c10d with an explicit endpoint and more than
    one node allowed); None otherwise, said once (nodes.py explains the choice of store)."""
    cfg = monitor.cfg
    if cfg.exclude_after_blames == 0 or config.max_nodes <= 1:
        return None
    if config.rdzv_backend != "c10d":
        log.warning("robust run: node exclusion needs --rdzv-backend c10d (its store holds the blame "
                    "counts every node reads); with %r no node is excluded.", config.rdzv_backend)
        return None
    host, port = parse_rendezvous_endpoint(config.rdzv_endpoint, default_port=29400)
    # A client of the store the c10d rendezvous hosts on one node; it exists by now (creating the
    # rendezvous handler above connected to it, or started it). Bounded like the rendezvous.
    timeout = datetime.timedelta(seconds=float(config.rdzv_configs.get("read_timeout", 60)))
    store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    return NodeRegistry(store, node, monitor.run_dir, cfg.exclude_after_blames)
