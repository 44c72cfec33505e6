"""Warm standby workers for ``robust run``: interpreters that already imported the job's
libraries, handed a rank on a restart instead of starting a fresh ``python``.

A cold restart pays about 2.5 s of CPU per rank for ``import torch, deepspeed, robust_plugins``
on these machines (minutes with CUDA and thousands of hosts): a standby has paid it already,
while the previous incarnation trained. The pool lives in the node's agent:

- **what a standby imports** (:func:`preimports`): torch and the plugin always; then every module
  the script names in an ``import`` statement whose top-level package is a library in
  :data:`PREIMPORT_ROOTS` (DeepSpeed, megatron-core, transformers, ...), read from the script's
  source without running it. Never the script itself nor any other module of the user's: their
  module-level code must run once per incarnation, at the hand-off, with the rank known.
- **when** (:meth:`StandbyPool.tick`, called from the agent's monitor loop): once the current
  incarnation reported a step (so imports never compete with the ranks' own start), up to one
  standby per local rank; a standby that dies, refuses (CUDA touched) or is not ready within
  ``ready_timeout_s`` is killed and replaced.
- **the hand-off** (:meth:`StandbyPool.hand`): the rank's full environment, argv, working
  directory and output files go down a pipe; the standby answers ``go`` within
  ``ack_timeout_s`` (else it is killed, and the rank starts cold). Only variables that name the
  rank and incarnation may differ from the environment the standby was started with
  (:func:`import_env_mismatch`); anything else (``OMP_NUM_THREADS``, ``CUDA_VISIBLE_DEVICES``, a
  path) could have changed what the imports did, so such a standby is retired, not used.
- **no orphans**: standbys are spawned (never forked) from the agent's main thread, in their own
  session, with ``PR_SET_PDEATHSIG`` (SIGKILL when the agent dies, set before they import); the
  pool kills every unused one when the agent ends. ``standbys.jsonl`` in the run directory
  records every standby's life.
"""

from __future__ import annotations

import ast
import datetime
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from robust_plugins._logging import get_logger
from robust_plugins.watchdog import standby_worker as _worker

log = get_logger(__name__)

#: Libraries a standby may import before its rank is known: none of them reads the rank or
#: touches a device at import (DeepSpeed probes ``torch.cuda.is_available()``, no context).
PREIMPORT_ROOTS = ("torch", "deepspeed", "megatron", "robust_plugins", "numpy", "transformers",
                   "accelerate", "triton")

#: Always imported: the interpreter's dominant cost (~2 s here) and the plugin the job runs under.
ALWAYS = ("torch", "robust_plugins", "robust_plugins.watchdog")

#: What a host imports lazily inside its own setup, imported after the host itself. DeepSpeed
#: 0.19's ``deepspeed.initialize`` imports its Muon optimizer module (``torch.compile`` at module
#: level), which with torch.optim's lazy ``torch._dynamo`` pulls in dynamo and inductor: 94 % of
#: a rank's ``initialize`` in a cProfile on 4 CPU ranks (BENCHMARKS.md, issue 15). Only
#: imports: nothing is compiled, and the CUDA check before ``ready`` still guards the device.
HOST_LAZY = {"deepspeed": ("torch._dynamo", "deepspeed.runtime.zero.muon.muon_optimizer"),
             # the engine patch imports the codecs (and triton_ops' custom ops) when it attaches
             "robust_plugins": ("robust_plugins.comm",)}

#: Seconds a standby may take to import before it counts as hung (four importing on two
#: loaded cores took up to ~20 s here).
READY_TIMEOUT_S = 300.0

#: Seconds a ready standby has to acknowledge its hand-off (it only parses one JSON line).
ACK_TIMEOUT_S = 5.0

#: An idle standby is pinged every PING_EVERY_S and counts as hung (killed, replaced) when it
#: has not answered within PING_TIMEOUT_S: found before a restart needs it, not at the restart.
PING_EVERY_S = 2.0
PING_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Target:
    """What the ranks run: ``python -u script args`` or ``python -u -m module args``."""

    script: str | None
    module: str | None
    args: tuple[str, ...]


def target_of(entrypoint: str, args: Iterable[Any]) -> tuple[Target | None, str]:
    """The ranks' script or module, or (None, why a standby cannot run it)."""
    args = [str(a) for a in args]
    if os.path.realpath(entrypoint) != os.path.realpath(sys.executable):
        return None, f"the entrypoint {entrypoint!r} is not this Python ({sys.executable}; --no-python?)"
    if not args or args[0] != "-u":
        return None, f"the worker command {args[:2]} is not torchrun's 'python -u ...'"
    rest = args[1:]
    if len(rest) >= 2 and rest[0] == "-m":
        return Target(None, rest[1], tuple(rest[2:])), ""
    if rest and not rest[0].startswith("-"):
        return Target(rest[0], None, tuple(rest[1:])), ""
    return None, f"interpreter options {rest[:1]} are not supported by standbys"


def _module_source(name: str, cwd: str) -> str | None:
    # Found on the path without importing anything (importing a package's __init__ would run
    # user code before the rank is known): ``python -m`` searches the working directory first.
    parts = name.split(".")
    for entry in [cwd, *sys.path[1:]]:
        base = os.path.join(entry or cwd, *parts)
        for path in (base + ".py", os.path.join(base, "__main__.py")):
            if os.path.isfile(path):
                return path
    if parts[0] in PREIMPORT_ROOTS:
        # A library module the path walk cannot see: one an import hook maps, as the editable
        # install maps robust_plugins.recipes to the top-level recipes/. Asking the import system
        # imports its parent packages, which is safe for these libraries (a standby imports them
        # anyway), never for user code.
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            return None
        if spec is not None and spec.origin and os.path.isfile(spec.origin):
            if spec.submodule_search_locations:  # a package run with -m: its __main__
                main = os.path.join(os.path.dirname(spec.origin), "__main__.py")
                return main if os.path.isfile(main) else None
            return spec.origin
    return None


def preimports(target: Target, cwd: str) -> list[str]:
    """Modules a standby imports for ``target``: :data:`ALWAYS`, then the library modules the
    script's source imports (absolute imports under :data:`PREIMPORT_ROOTS`), in source order,
    never the target module itself; last, :data:`HOST_LAZY` of the hosts among them."""
    path = target.script if target.module is None else _module_source(target.module, cwd)
    names = list(ALWAYS)
    if path is not None:
        try:
            tree = ast.parse(Path(path if os.path.isabs(path) else os.path.join(cwd, path)).read_bytes())
        except (OSError, SyntaxError, ValueError):
            tree = None  # the script's own start reports it
        for node in ast.walk(tree) if tree is not None else ():
            if isinstance(node, ast.Import):
                names += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.append(node.module)
    own = target.module  # runpy runs it as __main__; imported before, its body would run twice
    keep = [n for n in names if n in ALWAYS or (n.split(".")[0] in PREIMPORT_ROOTS and n != own)]
    for root in dict.fromkeys(n.split(".")[0] for n in list(keep)):
        keep += HOST_LAZY.get(root, ())
    return list(dict.fromkeys(keep))


def import_env_mismatch(spawn_env: dict[str, str], rank_env: dict[str, str],
                        per_rank: Callable[[str], bool]) -> list[str]:
    """Variables, other than those ``per_rank`` names, whose value differs between the
    environment a standby imported under and the one its rank must see."""
    keys = set(spawn_env) | set(rank_env)
    return sorted(k for k in keys if not per_rank(k) and spawn_env.get(k) != rank_env.get(k))


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


@dataclass
class Standby:
    """One pre-started interpreter."""

    proc: subprocess.Popen
    status: int
    handoff: int
    env: dict[str, str]
    spawned: float
    ready: dict | None = None
    pinged: float | None = None
    """When the unanswered ping was sent (None: none outstanding)."""
    answered: float = 0.0
    buf: bytes = b""
    events: list[dict] = field(default_factory=list)


class StandbyPool:
    """The node's standbys (see the module docstring); every method runs on the agent's main
    thread (PR_SET_PDEATHSIG follows the spawning thread)."""

    def __init__(self, size: int, target: Target, run_dir: Path, per_rank: Callable[[str], bool],
                 ready_timeout_s: float = READY_TIMEOUT_S, ack_timeout_s: float = ACK_TIMEOUT_S) -> None:
        self.size = size
        self.target = target
        self.cwd = os.getcwd()
        self.modules = preimports(target, self.cwd)
        self.per_rank = per_rank
        self.ready_timeout_s = ready_timeout_s
        self.ack_timeout_s = ack_timeout_s
        self.log_path = Path(run_dir) / "standbys.jsonl"
        self.standbys: list[Standby] = []
        self.closed = False

    # -- bookkeeping ---------------------------------------------------------------------------
    def _note(self, sb: Standby | None, event: str, **extra: Any) -> None:
        rec = {"time": _now(), "event": event, "pid": sb.proc.pid if sb else None, **extra}
        with open(self.log_path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def _spawn(self) -> Standby:
        status_r, status_w = os.pipe()
        handoff_r, handoff_w = os.pipe()
        env = {k: v for k, v in os.environ.items() if not self.per_rank(k)}
        env.update({_worker.ENV_STATUS_FD: str(status_w), _worker.ENV_HANDOFF_FD: str(handoff_r),
                    _worker.ENV_PARENT: str(os.getpid()), _worker.ENV_PREIMPORT: ",".join(self.modules)})
        proc = subprocess.Popen([sys.executable, "-u", "-m", _worker.__name__], env=env, cwd=self.cwd,
                                pass_fds=(status_w, handoff_r), start_new_session=True)
        # stdin, stdout, stderr: the agent's, inherited as torch's own Popen of a rank does.
        os.close(status_w)
        os.close(handoff_r)
        os.set_blocking(status_r, False)
        for k in _worker.STANDBY_ENV:
            env.pop(k)
        sb = Standby(proc, status_r, handoff_w, env, time.monotonic())
        self.standbys.append(sb)
        self._note(sb, "spawned", modules=self.modules)
        return sb

    def _read(self, sb: Standby) -> list[dict]:
        try:
            while True:
                chunk = os.read(sb.status, 1 << 16)
                if not chunk:
                    break
                sb.buf += chunk
        except BlockingIOError:
            pass
        lines, _, sb.buf = sb.buf.rpartition(b"\n")
        return [json.loads(x) for x in lines.split(b"\n") if x.strip()]

    def _retire(self, sb: Standby, event: str, **extra: Any) -> None:
        if sb in self.standbys:
            self.standbys.remove(sb)
        if sb.proc.poll() is None:
            try:
                os.killpg(sb.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            sb.proc.wait(timeout=10)
        for fd in (sb.status, sb.handoff):
            try:
                os.close(fd)
            except OSError:
                pass
        self._note(sb, event, exitcode=sb.proc.returncode, **extra)

    # -- the agent's calls -------------------------------------------------------------------
    def tick(self, spawn: bool) -> None:
        """Read the standbys' news, replace the dead, refused and hung; with ``spawn``, start
        standbys up to ``size``."""
        if self.closed:
            return
        now = time.monotonic()
        for sb in list(self.standbys):
            for msg in self._read(sb):
                if msg.get("k") == "pong":
                    sb.pinged, sb.answered = None, now
                elif msg.get("k") == "ready":
                    sb.ready, sb.answered = msg, now
                    self._note(sb, "ready", after_s=round(now - sb.spawned, 3),
                               import_s=msg.get("import_s"), failed=msg.get("failed"))
                elif msg.get("k") == "refused":
                    log.warning("robust run: a standby refused to serve: %s; restarts start cold.",
                                msg.get("why"))
                    self._retire(sb, "refused", why=msg.get("why"))
                    self.size = 0  # the same imports would touch CUDA again in every standby
            if sb not in self.standbys:
                continue
            if sb.proc.poll() is not None:
                self._retire(sb, "died")
            elif sb.ready is None and now - sb.spawned > self.ready_timeout_s:
                self._retire(sb, "hung", why=f"not ready within {self.ready_timeout_s:.0f} s")
            elif sb.pinged is not None and now - sb.pinged > PING_TIMEOUT_S:
                self._retire(sb, "hung", why=f"no answer to a ping within {PING_TIMEOUT_S:.0f} s")
            elif sb.ready is not None and sb.pinged is None and now - sb.answered > PING_EVERY_S:
                try:
                    os.write(sb.handoff, b'{"k": "ping"}\n')
                    sb.pinged = now
                except OSError:
                    self._retire(sb, "died", why="its hand-off pipe is closed")
        while spawn and len(self.standbys) < self.size:
            self._spawn()

    def take(self, wait_s: float) -> Standby | None:
        """A ready standby; else wait up to ``wait_s`` for one still importing (it started
        before a fresh process would, so waiting never costs more than a cold start)."""
        deadline = time.monotonic() + wait_s
        while True:
            self.tick(spawn=False)
            ready = [sb for sb in self.standbys if sb.ready is not None and sb.pinged is None]
            if ready:
                sb = min(ready, key=lambda s: s.spawned)
                self.standbys.remove(sb)
                return sb
            if not self.standbys or time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def hand(self, sb: Standby, target: Target, env: dict[str, str], stdout: str | None,
             stderr: str | None, rank: str) -> bool:
        """Give ``sb`` its rank; True once it acknowledged (it runs the script now)."""
        bad = import_env_mismatch(sb.env, env, self.per_rank)
        if bad or os.getcwd() != self.cwd:
            why = f"environment changed since it imported: {bad[:5]}" if bad else "cwd changed"
            self._retire(sb, "retired", why=why)
            log.warning("robust run: a standby was not used for rank %s (%s); started cold", rank, why)
            return False
        t = target
        job = {"env": env, "cwd": self.cwd, "stdout": stdout, "stderr": stderr,
               "script": t.script, "module": t.module, "args": list(t.args)}
        try:
            os.write(sb.handoff, (json.dumps(job) + "\n").encode())
        except OSError as exc:
            self._retire(sb, "died", why=f"hand-off failed: {exc!r}")
            return False
        deadline = time.monotonic() + self.ack_timeout_s
        while time.monotonic() < deadline and sb.proc.poll() is None:
            if any(m.get("k") == "go" for m in self._read(sb)):  # a pong may come before it
                os.close(sb.status)
                os.close(sb.handoff)
                self._note(sb, "served", rank=int(rank))
                return True
            time.sleep(0.005)
        self._retire(sb, "hung", why=f"no acknowledgement of the hand-off within {self.ack_timeout_s:.0f} s")
        return False

    def close(self) -> None:
        """Kill every unused standby (the agent is ending)."""
        self.closed = True
        for sb in list(self.standbys):
            self._retire(sb, "stopped")
