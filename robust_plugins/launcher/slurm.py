"""SLURM: what ``robust run`` under ``srun`` takes from the job, and the drain/requeue decision.

Pure functions of the environment and of blame records; the only process this module starts is
``scontrol`` (:func:`run_scontrol`, bounded), and only where the caller asks for it.

Under ``srun`` with one task per node, every agent reads (SLURM's names, set by ``slurmstepd``):

============================  ====================================================================
``SLURM_JOB_ID``              the rendezvous id (``--rdzv-id``): every node of the job agrees on it
``SLURM_NNODES``              ``--nnodes`` (the allocation's node count, less ``spares``)
``SLURM_NODEID``              0 hosts the c10d store (``is_host=true`` in ``--rdzv-conf``)
``SLURM_JOB_NODELIST``        its first host is the ``--rdzv-endpoint`` (compressed syntax expanded
                              by :func:`expand_hostlist`, the way ``scontrol show hostnames`` does)
``SLURMD_NODENAME``           the node's name in blames, ``faults.jsonl`` and ``scontrol`` calls
``SLURM_NTASKS``              must equal ``SLURM_NNODES``: one agent a node (``--ntasks-per-node=1``)
============================  ====================================================================

Flags given on the command line (or through torchrun's ``PET_*`` variables) win over all of it.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from robust_plugins._logging import get_logger
from robust_plugins.errors import ConfigError, RobustPluginsError

log = get_logger(__name__)

#: The c10d store's port is 29400 + job id mod 1000: two jobs whose first node is the same host
#: (a shared partition, or a job's requeued successor before the old store has closed) get
#: different ports; 29400-30399 sits below Linux's ephemeral range (32768+).
RDZV_BASE_PORT = 29400
RDZV_PORT_SPAN = 1000

#: ``scontrol`` talks to slurmctld; 30 s is 3x its default MessageTimeout (10 s).
SCONTROL_TIMEOUT_S = 30.0

#: One line per action taken through the scheduler, in the node's run directory (``FORMAT.md``).
SCHEDULER_FILE = "scheduler.jsonl"

_RANGE_RE = re.compile(r"^(\d+)(?:-(\d+))?$")


class SlurmError(RobustPluginsError):
    """The SLURM environment is inconsistent, or ``scontrol`` failed."""


def expand_hostlist(spec: str) -> list[str]:
    """SLURM's compressed host list as names, in order: ``"node[01-03,07],gpu5"`` ->
    ``["node01", "node02", "node03", "node07", "gpu5"]``.

    Several bracket groups in one name multiply (``"r[1-2]n[1-2]"`` -> r1n1, r1n2, r2n1, r2n2, the
    leftmost slowest, as ``scontrol show hostnames`` prints them); a range keeps the zero padding
    of its lower bound. Raises :class:`ConfigError` naming the bad part.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"host list {spec!r} is empty; expected e.g. 'node[01-03,07]'.")
    hosts: list[str] = []
    for name in _split_top(spec.strip(), spec):
        hosts.extend(_expand_one(name, spec))
    return hosts


def _split_top(text: str, spec: str) -> list[str]:
    # Commas split hosts only outside brackets: "a[1,3],b" is two names, not three.
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ConfigError(f"host list {spec!r}: nested '[' at position {i}.")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"host list {spec!r}: ']' without '[' at position {i}.")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ConfigError(f"host list {spec!r}: '[' is never closed.")
    parts.append(text[start:])
    for p in parts:
        if not p.strip():
            raise ConfigError(f"host list {spec!r} has an empty name (two commas in a row?).")
    return [p.strip() for p in parts]


def _expand_one(name: str, spec: str) -> list[str]:
    open_at = name.find("[")
    if open_at < 0:
        return [name]
    close_at = name.index("]", open_at)
    prefix, body, rest = name[:open_at], name[open_at + 1:close_at], name[close_at + 1:]
    values: list[str] = []
    for item in body.split(","):
        m = _RANGE_RE.match(item.strip())
        if not m:
            raise ConfigError(f"host list {spec!r}: {item!r} in [{body}] is not N or N-M (digits).")
        lo, hi = m.group(1), m.group(2)
        if hi is None:
            values.append(lo)
            continue
        if int(hi) < int(lo):
            raise ConfigError(f"host list {spec!r}: range {item!r} runs backwards.")
        values.extend(str(v).zfill(len(lo)) for v in range(int(lo), int(hi) + 1))
    return [f"{prefix}{v}{tail}" for v in values for tail in _expand_one(rest, spec)]


@dataclass(frozen=True)
class SlurmStep:
    """The SLURM facts one ``robust run`` agent started by ``srun`` reads (see the module table)."""

    job_id: str
    nnodes: int
    node_id: int
    ntasks: int
    hosts: tuple[str, ...]
    node_name: str

    @property
    def rdzv_port(self) -> int:
        """The c10d store's port for this job (``RDZV_BASE_PORT`` + job id mod ``RDZV_PORT_SPAN``)."""
        digits = re.sub(r"\D", "", self.job_id) or "0"
        return RDZV_BASE_PORT + int(digits) % RDZV_PORT_SPAN


def slurm_step(env: Mapping[str, str]) -> SlurmStep | None:
    """The step this process runs in, or ``None`` outside ``srun``.

    ``None`` also inside an ``sbatch`` script itself (no ``SLURM_STEP_ID``): there ``robust run``
    is one process on the first node, and taking ``SLURM_NNODES`` would wait for nodes that never
    start an agent. Raises :class:`SlurmError` when the step runs other than one task a node.
    """
    if "SLURM_JOB_ID" not in env or "SLURM_STEP_ID" not in env:
        return None
    need = ("SLURM_NNODES", "SLURM_NODEID", "SLURM_JOB_NODELIST")
    missing = [k for k in need if not env.get(k)]
    if missing:
        raise SlurmError(f"inside a SLURM step (SLURM_STEP_ID={env['SLURM_STEP_ID']}) but "
                         f"{', '.join(missing)} is not set; run `robust run` through srun.")
    nnodes, node_id = int(env["SLURM_NNODES"]), int(env["SLURM_NODEID"])
    ntasks = int(env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS") or nnodes)
    if ntasks != nnodes:
        raise SlurmError(
            f"SLURM_NTASKS = {ntasks} but SLURM_NNODES = {nnodes}: `robust run` is one agent a node and "
            f"starts the ranks itself. Launch it with `srun --ntasks-per-node=1 robust run "
            f"--nproc-per-node GPUS ...` (or give --nnodes/--rdzv-endpoint yourself).")
    hosts = tuple(expand_hostlist(env["SLURM_JOB_NODELIST"]))
    if len(hosts) != nnodes:
        raise SlurmError(f"SLURM_JOB_NODELIST = {env['SLURM_JOB_NODELIST']!r} names {len(hosts)} hosts "
                         f"but SLURM_NNODES = {nnodes}.")
    name = env.get("SLURMD_NODENAME") or hosts[node_id]
    return SlurmStep(env["SLURM_JOB_ID"], nnodes, node_id, ntasks, hosts, name)


def rendezvous_settings(step: SlurmStep, given: set[str], *, rdzv_conf: str = "",
                        spares: int = 0) -> dict[str, str]:
    """torchrun settings (by argparse ``dest``) this step implies, except those in ``given``.

    ``spares`` nodes of the allocation are hot spares (``robust run --spare`` on the last
    ``spares`` node ids): ``--nnodes`` is the rest. ``is_host`` (true on node 0, the endpoint's
    host) is added to ``rdzv_conf``, given or not, unless it names ``is_host`` already or the
    endpoint was given: the store then does not depend on the endpoint's name matching the
    host's own name.
    """
    if not 0 <= spares < step.nnodes:
        raise SlurmError(f"{spares} spare node(s) in a {step.nnodes}-node allocation: at least one "
                         f"node must train; allocate more nodes (sbatch --nodes) or fewer spares.")
    out = {
        "rdzv_backend": "c10d",
        "rdzv_endpoint": f"{step.hosts[0]}:{step.rdzv_port}",
        "rdzv_id": f"slurm-{step.job_id}",
        "nnodes": str(step.nnodes - spares),
    }
    out = {k: v for k, v in out.items() if k not in given}
    # Added to a given --rdzv-conf too: it only says which node hosts the store.
    if "is_host" not in rdzv_conf and "rdzv_endpoint" not in given:
        host = f"is_host={'true' if step.node_id == 0 else 'false'}"
        out["rdzv_conf"] = f"{rdzv_conf},{host}" if rdzv_conf else host
    return out


def is_spare(step: SlurmStep, spares: int) -> bool:
    """The last ``spares`` node ids of the allocation start as hot spares."""
    return step.node_id >= step.nnodes - spares


def drain_command(node: str, reason: str) -> list[str]:
    """``scontrol`` argv that drains ``node``: running steps finish, no new job lands on it."""
    if not re.fullmatch(r"[A-Za-z0-9._-]+", node or ""):
        raise SlurmError(f"node name {node!r} is not a SLURM node name (letters, digits, '.', '_', '-').")
    # scontrol takes Reason= as one argv element; quotes are for a shell, not needed here.
    return ["scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason=robust_plugins: {reason}"]


def requeue_command(job_id: str) -> list[str]:
    """``scontrol`` argv that requeues ``job_id`` (SLURM places it again, on no drained node)."""
    return ["scontrol", "requeue", job_id]


def requeue_decision(step: SlurmStep | None, env: Mapping[str, str], max_requeues: int) -> str | None:
    """Why this agent of a job that failed for good must NOT requeue it, or ``None`` when it must.

    Only node 0 asks (one request a job), only under SLURM, only with ``--slurm-requeue N`` and
    fewer than N requeues so far (``SLURM_RESTART_COUNT``), so a job that fails on every start
    stops after N tries instead of cycling through the queue.
    """
    if step is None:
        return "not a SLURM step"
    if max_requeues <= 0:
        return "--slurm-requeue not given"
    if step.node_id != 0:
        return f"node {step.node_name} is not node 0 (node 0 asks for the job)"
    done = int(env.get("SLURM_RESTART_COUNT") or 0)
    if done >= max_requeues:
        return f"requeued {done} time(s) already (--slurm-requeue {max_requeues})"
    return None


def nodes_to_drain(excluded: Sequence[Mapping[str, object]], drained: set[str]) -> list[str]:
    """Node names among exclusion records (``excluded_nodes.json`` entries) not yet drained."""
    out = []
    for record in excluded:
        node = str(record.get("node") or "")
        if node and node not in drained and node not in out:
            out.append(node)
    return out


def run_scontrol(argv: Sequence[str], *, timeout_s: float = SCONTROL_TIMEOUT_S) -> str:
    """Run one bounded ``scontrol`` command; its stdout, or :class:`SlurmError` with its stderr."""
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError as exc:
        raise SlurmError(f"`{argv[0]}` is not on PATH: {exc}; install SLURM's client tools "
                         f"or run with --no-slurm-drain.") from exc
    except subprocess.TimeoutExpired as exc:
        raise SlurmError(f"`{' '.join(argv)}` did not answer within {timeout_s:g} s.") from exc
    if proc.returncode != 0:
        raise SlurmError(f"`{' '.join(argv)}` failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def drain_excluded(record: Mapping[str, Any], run_dir: str | os.PathLike, *,
                   runner: Callable[[Sequence[str]], str] = run_scontrol) -> dict[str, Any]:
    """Drain the node of an exclusion record (``excluded_nodes.json`` entry) and say so.

    Appends ``{"time", "action": "drain", "node", "reason", "command", "ok", "error"}`` to
    ``<run_dir>/scheduler.jsonl`` and logs it. A failed ``scontrol`` is reported (``ok`` false,
    a warning naming the command to run by hand), never raised: the job's own exclusion stands
    either way. Returns the line written.
    """
    node = str(record.get("node"))
    reason = f"blamed {record.get('blames')} times by robust run; last: {record.get('reason')}"
    entry: dict[str, Any] = {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"),
                             "action": "drain", "node": node, "reason": reason, "command": None,
                             "ok": False, "error": None}
    try:
        argv = drain_command(node, reason)
        entry["command"] = argv
        runner(argv)
        entry["ok"] = True
        log.warning("robust run: node %s DRAINED in SLURM (%s); `scontrol update NodeName=%s State=RESUME` "
                    "returns it to service", node, reason, node)
    except SlurmError as exc:
        entry["error"] = str(exc)
        log.error("robust run: could not drain node %s in SLURM: %s", node, exc)
    with open(Path(run_dir) / SCHEDULER_FILE, "a") as f:
        f.write(json.dumps(entry) + "\n")
    return entry


def requeue_job(step: SlurmStep, run_dir: str | os.PathLike, why: str, *,
                runner: Callable[[Sequence[str]], str] = run_scontrol) -> dict[str, Any]:
    """Requeue ``step``'s job (``scontrol requeue``) and say so in ``scheduler.jsonl`` and the log;
    a failure is reported, never raised. Returns the line written."""
    argv = requeue_command(step.job_id)
    entry: dict[str, Any] = {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"),
                             "action": "requeue", "node": step.node_name, "reason": why, "command": argv,
                             "ok": False, "error": None}
    try:
        runner(argv)
        entry["ok"] = True
        log.warning("robust run: job %s REQUEUED in SLURM (%s); drained nodes are left out", step.job_id, why)
    except SlurmError as exc:
        entry["error"] = str(exc)
        log.error("robust run: could not requeue job %s: %s", step.job_id, exc)
    with open(Path(run_dir) / SCHEDULER_FILE, "a") as f:
        f.write(json.dumps(entry) + "\n")
    return entry
