"""``robust run``: torchrun with a fault watchdog, restarts that work on gloo, and fault injection.

Every torchrun option works unchanged (the parser *is* torchrun's), for example::

    robust run --standalone --nproc-per-node 4 train.py --steps 200
    robust run --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint host0:29400 ...

plus:

``--run-dir DIR``        where ``faults.jsonl``, ``monitor.log``, ``workers.jsonl`` and stack
                         dumps go (default ``runs/run-YYYYmmdd-HHMMSS``)
``--inject SPEC``        inject a fault, e.g. ``kill:rank=1,step=30``, ``hang:rank=0,step=20``,
                         ``nan:rank=1,step=40`` (see :mod:`robust_plugins.watchdog.inject`)
``--watchdog K=V``       one watchdog setting (``--watchdog hang_min_timeout_s=5``)
``--watchdog-config F``  a JSON file: a DeepSpeed config (its ``robust_plugins.watchdog`` block is
                         read) or a bare ``{"watchdog": {...}}`` block
``--no-standby``         no warm standby workers (every incarnation starts fresh interpreters)
``--spare``              a hot spare node: waits until the job runs, then replaces the first
                         node the job loses or excludes (same world size and global batch)

Restarts are on by default: ``--max-restarts`` defaults to 3 (``DEFAULT_MAX_RESTARTS``; torchrun's
is 0), with the watchdog's ``restart_backoff_s`` between them; ``--max-restarts 0`` means none.

Training scripts report steps with ``robust_plugins.watchdog.step_end(step, loss=..., grad_norm=...)``
and resume from their newest checkpoint on start (the resume contract in ``watchdog/FORMAT.md``).
Exit status: 0 when training completed (after any number of recovered faults), 1 when the job
failed for good (restart budget exhausted), 2 for a usage error, 3 when this node was excluded
from a multi-node job (blamed ``exclude_after_blames`` times; the others continue), 128+N when
stopped by signal N.

Multi-node (``--nnodes MIN:MAX --rdzv-backend c10d``): torch's rendezvous admits any node count in
the range; ``membership.jsonl`` records every round and a changed world size is printed. Give each
node its own ``--run-dir`` (or ``--local-addr``, which also names the node in blames).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import sys
import time
import uuid
from pathlib import Path

from robust_plugins.config import BLOCK_KEY, PluginConfig, WatchdogConfig, load_json
from robust_plugins.errors import ConfigError

#: torchrun's default --master-port (used by its static rendezvous only).
_TORCHRUN_MASTER_PORT = 29500

#: ``--max-restarts`` when not given (torchrun's default is 0: no restart). A fault-tolerance
#: launcher restarts by default; 3 is enough for a fault every few minutes of a short job and
#: stops a script that crashes on every start after 3 tries (each a cold or warm start), not
#: after hours. ``--max-restarts 0`` still means none; ``PET_MAX_RESTARTS`` sets it too.
DEFAULT_MAX_RESTARTS = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """torchrun's own options, then ours (all before the training script)."""
    from torch.distributed.run import get_args_parser

    ours = parser.add_argument_group("robust run")
    ours.add_argument("--run-dir", default=None,
                      help="run directory for faults.jsonl, monitor.log and stack dumps "
                           "(default runs/run-<date>-<time>)")
    ours.add_argument("--inject", action="append", default=[], metavar="SPEC",
                      help="inject a fault: kill:rank=R,step=S | hang:rank=R,step=S | "
                           "nan:rank=R,step=S (repeatable, or ';'-separated)")
    ours.add_argument("--watchdog", action="append", default=[], metavar="KEY=VALUE",
                      help="one watchdog setting, e.g. hang_min_timeout_s=5 (repeatable)")
    ours.add_argument("--watchdog-config", metavar="JSON",
                      help="DeepSpeed config or {\"watchdog\": {...}} file with watchdog settings")
    ours.add_argument("--no-standby", dest="standby", action="store_false",
                      help="no warm standby workers: every incarnation starts fresh interpreters "
                           "(default: each rank, the first incarnation's too, is forked from one "
                           "fork server a node that imported torch, the plugin and the script's "
                           "DeepSpeed/megatron-core imports once)")
    ours.add_argument("--spare", action="store_true",
                      help="start this node as a hot spare: same command as the job's nodes "
                           "(--nnodes MIN:MAX, c10d --rdzv-endpoint, --rdzv-id), started once or "
                           "after they run; it waits beyond MAX and joins when a node is lost or "
                           "excluded, so the job keeps its world size. Its ranks start cold.")
    ours.add_argument("--no-slurm-drain", dest="slurm_drain", action="store_false",
                      help="under srun: do not drain an excluded node in SLURM (default: its agent runs "
                           "`scontrol update NodeName=<node> State=DRAIN` and records it in scheduler.jsonl)")
    ours.add_argument("--slurm-requeue", type=int, default=0, metavar="N",
                      help="under srun: when the job fails for good (restart budget spent, too few "
                           "nodes left), node 0 requeues it (scontrol requeue; drained nodes are left "
                           "out), at most N times in all (SLURM_RESTART_COUNT). Default 0: never")
    ours.add_argument("--slurm-spares", type=int, default=0, metavar="N",
                      help="under srun: the last N nodes of the allocation start as hot spares "
                           "(--spare) and --nnodes is the rest (default 0)")
    # Reuse torchrun's parser actions as they are: same names, defaults, PET_* environment
    # fallbacks and help, so a torchrun command line works after `robust run`.
    for action in get_args_parser()._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if action.dest == "max_restarts":
            action = _restart_default(action)
        if action.dest in _SLURM_DERIVED:
            action = _noting_given(action)
        parser._add_action(action)


#: torchrun settings ``robust run`` derives from SLURM under srun unless given
#: (:func:`robust_plugins.launcher.slurm.rendezvous_settings`).
_SLURM_DERIVED = ("nnodes", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf", "standalone")


def _noting_given(action: argparse.Action) -> argparse.Action:
    # The same action, which also notes in the namespace that its flag was on the command line:
    # a flag the user gave wins over what SLURM implies, even when it equals torchrun's default.
    action = copy.copy(action)
    base = type(action)

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: N807
        given = getattr(namespace, "_robust_given", set())
        given.add(self.dest)
        setattr(namespace, "_robust_given", given)
        base.__call__(self, parser, namespace, values, option_string)

    action.__class__ = type(f"Noting{base.__name__}", (base,), {"__call__": __call__})
    return action


def given_flags(args: argparse.Namespace, env: dict | os._Environ = os.environ) -> set[str]:
    """The SLURM-derivable settings the user gave: on the command line or as torchrun's ``PET_*``."""
    given = set(getattr(args, "_robust_given", set()))
    given.update(d for d in _SLURM_DERIVED if env.get(f"PET_{d.upper()}"))
    return given


def apply_slurm(args: argparse.Namespace, env: dict | os._Environ = os.environ) -> str | None:
    """Fill the rendezvous settings from the SLURM step this agent runs in (see
    :mod:`robust_plugins.launcher.slurm`); flags given win. Returns a line saying what was taken,
    or ``None`` outside ``srun``."""
    from robust_plugins.launcher.slurm import is_spare, rendezvous_settings, slurm_step

    step = slurm_step(env)
    if step is None:
        if args.slurm_spares or args.slurm_requeue:
            raise ConfigError("--slurm-spares and --slurm-requeue need a SLURM step (run `robust run` under "
                              "srun); outside SLURM start spare nodes with --spare.")
        return None
    given = given_flags(args, env)
    args.slurm_node = step.node_name
    args.slurm_step = step
    if args.run_dir is None:
        # Nodes of a job often share the working directory (NFS): one run directory each.
        args.run_dir = str(Path("runs") / f"slurm-{step.job_id}" / step.node_name)
    if "standalone" in given:
        return f"robust run: SLURM job {step.job_id}: --standalone given, rendezvous not taken from SLURM"
    settings = rendezvous_settings(step, given, rdzv_conf=args.rdzv_conf, spares=args.slurm_spares)
    for dest, value in settings.items():
        setattr(args, dest, value)
    if is_spare(step, args.slurm_spares):
        args.spare = True
    taken = ", ".join(f"{k}={v}" for k, v in sorted(settings.items())) or "nothing (all flags given)"
    drain = ("a node excluded from the job is drained in SLURM (--no-slurm-drain: not)" if args.slurm_drain
             else "excluded nodes are not drained (--no-slurm-drain)")
    return (f"robust run: SLURM job {step.job_id}, node {step.node_name} ({step.node_id + 1} of "
            f"{step.nnodes}{', hot spare' if args.spare else ''}): took {taken}; {drain}")


def _restart_default(action: argparse.Action) -> argparse.Action:
    # torchrun's own action (its PET_MAX_RESTARTS fallback kept), with our default and help.
    action = copy.copy(action)
    # A string default goes through type=int (argparse), so a bad PET_MAX_RESTARTS is a usage error.
    action.default = os.environ.get("PET_MAX_RESTARTS") or DEFAULT_MAX_RESTARTS
    action.help = (f"restarts of the worker group before the job fails (default "
                   f"{DEFAULT_MAX_RESTARTS}; torchrun's is 0). Each restart waits "
                   f"restart_backoff_s (default 0 s, doubling each time, capped at "
                   f"restart_backoff_max_s) and is served by warm standby workers unless "
                   f"--no-standby. 0: no restart, the first fault ends the job.")
    return action


def watchdog_config(path: str | None, overrides: list[str]) -> WatchdogConfig:
    """The watchdog settings from ``--watchdog-config`` and ``--watchdog K=V`` (validated)."""
    settings: dict = {}
    if path:
        data = load_json(path)
        block = data.get(BLOCK_KEY, data)
        if not isinstance(block, dict):
            raise ConfigError(f"{path}: {BLOCK_KEY} must be a JSON object.")
        settings = dict(block.get("watchdog") or {})
    for item in overrides:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--watchdog {item!r} must be KEY=VALUE, e.g. hang_min_timeout_s=5.")
        try:
            settings[key.strip()] = json.loads(value)
        except ValueError:
            settings[key.strip()] = value
    cfg = PluginConfig.from_dict({"watchdog": settings}).watchdog
    return cfg if cfg is not None else WatchdogConfig()


def _resolve_rendezvous(args: argparse.Namespace) -> None:
    # What torchrun's own entry point decides before building its config: --standalone, and a
    # single node without an endpoint, get a private c10d rendezvous on a free port.
    from torch.distributed.run import parse_min_max_nnodes

    if args.standalone:
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    elif args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None:
        if parse_min_max_nnodes(args.nnodes)[1] == 1:
            args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = _TORCHRUN_MASTER_PORT


def _maybe_requeue(args: argparse.Namespace, run_dir: Path, why: str) -> None:
    from robust_plugins.launcher.slurm import SCHEDULER_FILE, requeue_decision, requeue_job

    not_now = requeue_decision(args.slurm_step, os.environ, args.slurm_requeue)
    if not_now is None:
        entry = requeue_job(args.slurm_step, run_dir, why)
        print(f"robust run: job {args.slurm_step.job_id} " + ("REQUEUED in SLURM" if entry["ok"] else
              f"NOT requeued: {entry['error']}") + f"; see {run_dir / SCHEDULER_FILE}", file=sys.stderr, flush=True)
    elif args.slurm_requeue:
        print(f"robust run: not requeueing the job: {not_now}", file=sys.stderr, flush=True)


def _new_run_dir(base: Path) -> Path:
    # Two launches in the same second must not share (and append to) one faults.jsonl.
    stem = base / time.strftime("run-%Y%m%d-%H%M%S")
    candidate, n = stem, 0
    while candidate.exists():
        n += 1
        candidate = stem.with_name(f"{stem.name}-{n}")
    return candidate


def run(args: argparse.Namespace) -> int:
    """Launch the job under the watchdog; see the module docstring for the exit status."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import config_from_args

    from robust_plugins.checkpoint.memory import ENV_JOB, job_files, job_key, remove_job
    from robust_plugins.watchdog import inject as _inject
    from robust_plugins.launcher.agent import check_spare, launch
    from robust_plugins.launcher.monitor import Monitor
    from robust_plugins.launcher.nodes import EXIT_EXCLUDED, NodeExcluded
    from robust_plugins.launcher.slurm import SCHEDULER_FILE, drain_excluded

    injections = _inject.parse(args.inject)
    cfg = watchdog_config(args.watchdog_config, args.watchdog)
    slurm_line = apply_slurm(args)
    _resolve_rendezvous(args)
    config, cmd, cmd_args = config_from_args(args)
    _inject.check_world(injections, config.nproc_per_node * config.max_nodes)
    if args.spare:
        check_spare(config)

    run_dir = Path(args.run_dir) if args.run_dir else _new_run_dir(Path("runs"))
    run_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(run_dir / "monitor.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    watched = [logging.getLogger("robust_plugins"), logging.getLogger("torch.distributed.elastic")]
    for lg in watched:
        lg.addHandler(handler)
    logging.getLogger("robust_plugins").setLevel(logging.INFO)
    (run_dir / "run.json").write_text(json.dumps({
        "argv": sys.argv, "watchdog": cfg.as_dict(),
        "inject": [i.spec() for i in injections], "max_restarts": config.max_restarts,
        "standby": args.standby, "spare": args.spare,
    }, indent=1) + "\n")
    print(f"robust run: run directory {run_dir} ({cfg.describe()})", flush=True)
    if slurm_line:
        print(slurm_line, flush=True)

    # One id for every incarnation of this job: names the ranks' in-memory snapshots
    # (checkpoint.memory_every), which a restarted rank restores from.
    os.environ.setdefault(ENV_JOB, str(run_dir.resolve()))
    monitor = Monitor(cfg, run_dir, injections,
                      host=args.local_addr or getattr(args, "slurm_node", None) or None)
    try:
        result = launch(config, cmd, cmd_args, monitor, standby=args.standby, spare=args.spare)
    except NodeExcluded as exc:
        # One line a scheduler can grep, then the reason; the ranks of this node were stopped.
        print(f"robust run: EXCLUDED NODE {exc.record['node']}", file=sys.stderr, flush=True)
        print(f"robust run: {exc} Record: {run_dir / 'excluded_nodes.json'}", file=sys.stderr, flush=True)
        if getattr(args, "slurm_node", None) and args.slurm_drain:
            entry = drain_excluded(exc.record, run_dir)
            print(f"robust run: node {entry['node']} " + ("DRAINED in SLURM" if entry["ok"] else
                  f"NOT drained in SLURM: {entry['error']}") + f"; see {run_dir / SCHEDULER_FILE}",
                  file=sys.stderr, flush=True)
        return EXIT_EXCLUDED
    except SignalException as exc:
        print(f"robust run: stopped by signal {exc.sigval}; ranks were shut down.", file=sys.stderr)
        return 128 + int(exc.sigval)
    finally:
        monitor.close()
        for lg in watched:
            lg.removeHandler(handler)
        handler.close()
    faults = monitor.all_faults
    if result is None:
        print("robust run: the job ended without needing this spare node; it ran no ranks.", flush=True)
        return 0
    if result.is_failed():
        last = faults[-1] if faults else None
        what = (f"last fault: {last.kind} at step {last.step}, suspect ranks {last.suspect_ranks}"
                if last else "a rank failed")
        failed = {r: getattr(f, "exitcode", None) for r, f in (result.failures or {}).items()}
        if last is not None and last.detail.get("refused"):
            print(f"robust run: job FAILED: {last.detail['reason'].rstrip('.')}. Not restarted. Faults: "
                  f"{run_dir / 'faults.jsonl'}", file=sys.stderr, flush=True)
            return 1
        why = (f"ranks {last.suspect_ranks} on {', '.join(last.suspect_hosts)} corrupted the same step "
               f"again when it was replayed from the checkpoint (persistent silent data corruption): "
               f"evicted; relaunch without that machine" if last is not None and last.action == "evict"
               else f"restart budget exhausted (--max-restarts {config.max_restarts})")
        print(f"robust run: job FAILED: {what}{f' (exit codes {failed})' if failed else ''}; "
              f"{why}. Faults: {run_dir / 'faults.jsonl'}", file=sys.stderr, flush=True)
        if getattr(args, "slurm_step", None) is not None:
            _maybe_requeue(args, run_dir, why)
        kept = job_files(job_key())
        if kept:
            print(f"robust run: {len(kept)} in-memory snapshot file(s) of this job are kept in /dev/shm "
                  f"({os.path.basename(kept[0]).rsplit('.r', 1)[0]}.*): relaunching with the same --run-dir "
                  f"restores from them; delete them if you will not.", file=sys.stderr, flush=True)
        return 1
    removed = remove_job(job_key())  # the ranks' snapshots: the job is done, they are not needed
    if removed:
        print(f"robust run: removed {removed} in-memory snapshot file(s) from /dev/shm", flush=True)
    print(f"robust run: training completed; {len(faults)} fault(s) recovered. "
          f"Faults: {run_dir / 'faults.jsonl'}", flush=True)
    return 0
