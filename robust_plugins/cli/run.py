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
    # Reuse torchrun's parser actions as they are: same names, defaults, PET_* environment
    # fallbacks and help, so a torchrun command line works after `robust run`.
    for action in get_args_parser()._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if action.dest == "max_restarts":
            action = _restart_default(action)
        parser._add_action(action)


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

    injections = _inject.parse(args.inject)
    cfg = watchdog_config(args.watchdog_config, args.watchdog)
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

    # One id for every incarnation of this job: names the ranks' in-memory snapshots
    # (checkpoint.memory_every), which a restarted rank restores from.
    os.environ.setdefault(ENV_JOB, str(run_dir.resolve()))
    monitor = Monitor(cfg, run_dir, injections, host=args.local_addr or None)
    try:
        result = launch(config, cmd, cmd_args, monitor, standby=args.standby, spare=args.spare)
    except NodeExcluded as exc:
        # One line a scheduler can grep, then the reason; the ranks of this node were stopped.
        print(f"robust run: EXCLUDED NODE {exc.record['node']}", file=sys.stderr, flush=True)
        print(f"robust run: {exc} Record: {run_dir / 'excluded_nodes.json'}", file=sys.stderr, flush=True)
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
