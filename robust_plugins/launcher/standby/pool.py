"""Warm standby workers for ``robust run``: interpreters that already imported the job's
libraries, handed a rank on a restart instead of starting a fresh ``python``.

A cold restart pays ``import torch, deepspeed, robust_plugins`` again on every rank (seconds of
CPU each, more with CUDA): a standby has paid it already, while the previous incarnation
trained. The pool lives in the node's agent:

- **what a standby imports** (:func:`preimports`): torch and the plugin always; then every module
  the script names in an ``import`` statement whose top-level package is a library in
  :data:`PREIMPORT_ROOTS` (DeepSpeed, megatron-core, transformers, ...), read from the script's
  source without running it. Never the script itself nor any other module of the user's: their
  module-level code must run once per incarnation, at the hand-off, with the rank known.
- **where from** (:mod:`.zygote`): one fork server per node imports them once and forks
  a standby per local rank on request (copy-on-write: one import's CPU and mostly one import's
  memory for the node). It forks only after checking that nothing makes a fork unsafe (other
  threads, CUDA); otherwise it says why, the pool logs a warning, records ``zygote_unsafe`` and
  spawns one interpreter per standby instead, each importing by itself (``fork=False`` too).
- **when** (:meth:`StandbyPool.tick`): at the job's start, one per local rank for the first
  incarnation when forking is possible (the fork server's one import replaces the ranks' own);
  then, from the agent's monitor loop, once the current incarnation reported a step, up to one
  standby per local rank; a standby or fork server that dies, refuses (CUDA touched) or is not
  ready within ``ready_timeout_s`` or does not answer a ping is killed and replaced.
- **the hand-off** (:meth:`StandbyPool.hand`): the rank's full environment, argv, working
  directory and output files go down a pipe; the standby answers ``go`` within
  ``ack_timeout_s`` (else it is killed, and the rank starts cold). Only variables that name the
  rank and incarnation may differ from the environment the standby was started with
  (:func:`import_env_mismatch`); anything else (``OMP_NUM_THREADS``, ``CUDA_VISIBLE_DEVICES``, a
  path) could have changed what the imports did, so such a standby is retired, not used (and a
  fork server whose environment differs from the agent's is replaced before it forks again).
- **no orphans**: the fork server and spawned standbys are started from the agent's main thread,
  never forked from the agent, in their own sessions, with ``PR_SET_PDEATHSIG`` (SIGKILL when the
  agent dies, set before they import); a forked standby sets it towards the fork server, so the
  agent's death takes the server and the server's takes its children. The pool therefore never
  kills a fork server while a rank it forked runs (it drains: unused, then killed once those
  ranks ended), and kills every unused standby when the agent ends. ``standbys.jsonl`` in the run
  directory records every standby's and fork server's life.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from robust_plugins._logging import get_logger
from robust_plugins.launcher.standby import worker as _worker
from robust_plugins.launcher.standby.fork import ForkedProc, Zygote
from robust_plugins.patches import host_preimports

log = get_logger(__name__)

#: Libraries a standby may import before its rank is known: none of them reads the rank or
#: touches a device at import (DeepSpeed probes ``torch.cuda.is_available()``, no context).
PREIMPORT_ROOTS = ("torch", "deepspeed", "megatron", "robust_plugins", "numpy", "transformers",
                   "accelerate", "triton")

#: Always imported: the interpreter's dominant cost (~2 s here) and the plugin the job runs under.
ALWAYS = ("torch", "robust_plugins", "robust_plugins.watchdog")

#: What a package imports lazily inside its own setup, imported after the package itself: the
#: hosts' lists (``patches/host_preimports.py``, which may name host internals), and the plugin's
#: (the engine patch imports the codecs and triton_ops' custom ops when it attaches). Only
#: imports: nothing is compiled, and the CUDA check before ``ready`` still guards the device.
HOST_LAZY = {**host_preimports.LAZY, "robust_plugins": ("robust_plugins.comm",)}

#: What a host imports lazily when the script uses one of its names (``DistributedDataParallel``
#: imports ``torch._dynamo``; ``patches/host_preimports.py``): imported after :data:`HOST_LAZY`.
HOST_ON_USE = {**host_preimports.ON_USE, "robust_plugins": {"Snapshotter": ("robust_plugins.snapshot",)}}

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
    never the target module itself; last, :data:`HOST_LAZY` of the hosts among them, then
    :data:`HOST_ON_USE` of those hosts for the names the source uses."""
    path = target.script if target.module is None else _module_source(target.module, cwd)
    names = list(ALWAYS)
    used: set[str] = set()
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
                used.update(a.name for a in node.names)
            elif isinstance(node, ast.Attribute):
                used.add(node.attr)
            elif isinstance(node, ast.Name):
                used.add(node.id)
    own = target.module  # runpy runs it as __main__; imported before, its body would run twice
    keep = [n for n in names if n in ALWAYS or (n.split(".")[0] in PREIMPORT_ROOTS and n != own)]
    roots = list(dict.fromkeys(n.split(".")[0] for n in keep))
    for root in roots:
        keep += HOST_LAZY.get(root, ())
    for root in roots:
        for name, modules in HOST_ON_USE.get(root, {}).items():
            if name in used:
                keep += modules
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
    """One pre-started standby: forked from the node's zygote or spawned."""

    proc: subprocess.Popen | ForkedProc
    status: int
    handoff: int
    env: dict[str, str]
    spawned: float
    ready: dict | None = None
    pinged: float | None = None
    """When the unanswered ping was sent (None: none outstanding)."""
    answered: float = 0.0
    buf: bytes = b""
    zygote: Zygote | None = None
    """The fork server it came from (None: spawned)."""
    announced: bool = False
    """``spawned`` is in standbys.jsonl (a fork's pid is known only once the zygote forked)."""


class StandbyPool:
    """The node's standbys (see the module docstring); every method runs on the agent's main
    thread (PR_SET_PDEATHSIG follows the spawning thread). ``fork=False``: spawn every standby."""

    def __init__(self, size: int, target: Target, run_dir: Path, per_rank: Callable[[str], bool],
                 ready_timeout_s: float = READY_TIMEOUT_S, ack_timeout_s: float = ACK_TIMEOUT_S,
                 fork: bool = True) -> None:
        self.size = size
        self.target = target
        self.cwd = os.getcwd()
        self.modules = preimports(target, self.cwd)
        self.per_rank = per_rank
        self.ready_timeout_s = ready_timeout_s
        self.ack_timeout_s = ack_timeout_s
        self.fork = fork
        self.log_path = Path(run_dir) / "standbys.jsonl"
        self.standbys: list[Standby] = []
        self.zygote: Zygote | None = None
        self.draining: list[Zygote] = []
        """Retired fork servers that ranks they forked still run in (their death would kill them)."""
        self.closed = False

    # -- bookkeeping ---------------------------------------------------------------------------
    def _note(self, who: Standby | Zygote | None, event: str, **extra: Any) -> None:
        rec = {"time": _now(), "event": event, "pid": who.proc.pid if who else None, **extra}
        with open(self.log_path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def _import_env(self) -> dict[str, str]:
        return {k: v for k, v in os.environ.items() if not self.per_rank(k)}

    def _spawn(self) -> bool:
        status_r, status_w = os.pipe()
        handoff_r, handoff_w = os.pipe()
        env = self._import_env()
        spawn_env = {**env, _worker.ENV_STATUS_FD: str(status_w), _worker.ENV_HANDOFF_FD: str(handoff_r),
                     _worker.ENV_PARENT: str(os.getpid()), _worker.ENV_PREIMPORT: ",".join(self.modules)}
        try:
            proc = subprocess.Popen([sys.executable, "-u", "-m", _worker.__name__], env=spawn_env, cwd=self.cwd,
                                    pass_fds=(status_w, handoff_r), start_new_session=True)
        finally:
            # stdin, stdout, stderr: the agent's, inherited as torch's own Popen of a rank does.
            os.close(status_w)
            os.close(handoff_r)
        os.set_blocking(status_r, False)
        sb = Standby(proc, status_r, handoff_w, env, time.monotonic(), announced=True)
        self.standbys.append(sb)
        self._note(sb, "spawned", modules=self.modules)
        return True

    def _fork(self) -> bool:
        # A fork request: the standby exists (take() may wait for it) before the zygote forks it.
        env = self._import_env()
        z = self.zygote
        if z is not None and z.env != env:
            changed = import_env_mismatch(z.env, env, lambda _: False)
            self._drop_zygote(z, "zygote_retired", why=f"environment changed since it imported: {changed[:5]}")
            z = None
        if z is None:
            z = self.zygote = Zygote(env, self.cwd, self.modules)
            self._note(z, "zygote_spawned", modules=self.modules)
        status_r, status_w = os.pipe()
        handoff_r, handoff_w = os.pipe()
        try:
            proc = z.fork(status_w, handoff_r)
        except OSError as exc:
            os.close(status_r)
            os.close(handoff_w)
            self._drop_zygote(z, "zygote_died", why=f"fork request failed: {exc!r}")
            return False
        finally:
            os.close(status_w)
            os.close(handoff_r)
        os.set_blocking(status_r, False)
        self.standbys.append(Standby(proc, status_r, handoff_w, env, time.monotonic(), zygote=z))
        return True

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
            if isinstance(sb.proc, ForkedProc):
                sb.proc.kill()  # through its pidfd; unused, it has started no process of its own
            else:
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

    def _drop_zygote(self, z: Zygote, event: str, **extra: Any) -> None:
        # Its unused standbys go; the server itself too, unless ranks it forked still run.
        if self.zygote is z:
            self.zygote = None
        served = z.live_served()
        if not served:
            z.stop()
        for sb in [sb for sb in self.standbys if sb.zygote is z]:
            self._retire(sb, "stopped", why=f"its fork server {z.pid}: {event}")
        if served:
            self.draining.append(z)
            extra["draining"] = [c.pid for c in served]
        self._note(z, event, exitcode=z.proc.returncode, **extra)

    def _liveness(self, who: Standby | Zygote, alive: bool, ping: Callable[[], object],
                  now: float) -> tuple[str, dict[str, str]] | None:
        """("died" or "hung", the note's extra fields) for a standby or fork server that must go,
        else None; sends it a ping when one is due."""
        if not alive:
            return "died", {}
        if who.ready is None and now - who.spawned > self.ready_timeout_s:
            return "hung", {"why": f"not ready within {self.ready_timeout_s:.0f} s"}
        if who.pinged is not None and now - who.pinged > PING_TIMEOUT_S:
            return "hung", {"why": f"no answer to a ping within {PING_TIMEOUT_S:.0f} s"}
        if who.ready is not None and who.pinged is None and now - who.answered > PING_EVERY_S:
            try:
                ping()
            except OSError as exc:
                return "died", {"why": f"ping failed: {exc!r}"}
            who.pinged = now
        return None

    def _tick_zygotes(self, now: float) -> None:
        z = self.zygote
        alive = z is not None and z.alive()  # first: what it said before it exited is read next
        if z is not None:
            z.pump()
            for msg in z.news:
                if msg["k"] == "ready":
                    self._note(z, "zygote_ready", after_s=round(now - z.spawned, 3), import_s=msg["import_s"],
                               failed=msg["failed"], threads_before_probe=msg["threads_before_probe"])
                elif msg["k"] == "refused":
                    log.warning("robust run: the standby fork server refused to serve: %s; restarts start "
                                "cold.", msg["why"])
                    self._drop_zygote(z, "refused", why=msg["why"])
                    self.size = 0  # the same imports would touch CUDA in every standby
                else:
                    log.warning("robust run: forking standbys is unsafe here: %s. Standbys are spawned "
                                "instead, one interpreter and one import per rank (more CPU and memory "
                                "a node; restarts stay warm). To fork them, let nothing imported start a "
                                "thread or call CUDA (robust_plugins/launcher/standby/zygote.py says "
                                "why).", msg["why"])
                    asked = sum(sb.zygote is z for sb in self.standbys)
                    self._drop_zygote(z, "zygote_unsafe", why=msg["why"])
                    self.fork = False
                    for _ in range(asked):  # already asked for: a restart may be waiting on them
                        self._spawn()
            z.news.clear()
        if z is not None and self.zygote is z:
            verdict = self._liveness(z, alive, z.ping, now)
            if verdict is not None:
                self._drop_zygote(z, f"zygote_{verdict[0]}", **verdict[1])
        for old in list(self.draining):
            if not old.live_served():
                self.draining.remove(old)
                self._note(old, "zygote_stopped", exitcode=old.stop(), why="the ranks it forked ended")

    # -- the agent's calls -------------------------------------------------------------------
    def tick(self, spawn: bool) -> None:
        """Read the standbys' and fork server's news, replace the dead, refused and hung; with
        ``spawn``, start standbys up to ``size``."""
        if self.closed:
            return
        now = time.monotonic()
        self._tick_zygotes(now)
        for sb in list(self.standbys):
            if not sb.announced:
                if sb.proc.pid is None:
                    continue  # not forked yet: its fork server's liveness (above) is its own
                sb.announced = True
                self._note(sb, "spawned", zygote=sb.zygote.pid, fork_s=round(now - sb.spawned, 3))
            alive = sb.proc.poll() is None  # first, as for the fork server
            for msg in self._read(sb):
                if msg.get("k") == "pong":
                    sb.pinged, sb.answered = None, now
                elif msg.get("k") == "ready":
                    sb.ready, sb.answered = msg, now
                    self._note(sb, "ready", after_s=round(now - sb.spawned, 3),
                               import_s=msg.get("import_s"), failed=msg.get("failed"),
                               **({"zygote": msg["zygote"]} if "zygote" in msg else {}))
                elif msg.get("k") == "refused":
                    log.warning("robust run: a standby refused to serve: %s; restarts start cold.",
                                msg.get("why"))
                    self._retire(sb, "refused", why=msg.get("why"))
                    self.size = 0  # the same imports would touch CUDA again in every standby
            if sb not in self.standbys:
                continue
            verdict = self._liveness(sb, alive, lambda fd=sb.handoff: os.write(fd, b'{"k": "ping"}\n'), now)
            if verdict is not None:
                self._retire(sb, verdict[0], **verdict[1])
        while spawn and len(self.standbys) < self.size:
            if not (self._fork() if self.fork else self._spawn()):
                break

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
                if isinstance(sb.proc, ForkedProc):
                    sb.proc.served = True  # its fork server now outlives it (see _drop_zygote)
                self._note(sb, "served", rank=int(rank))
                return True
            time.sleep(0.005)
        self._retire(sb, "hung", why=f"no acknowledgement of the hand-off within {self.ack_timeout_s:.0f} s")
        return False

    def close(self) -> None:
        """Kill every unused standby and every fork server no rank runs in (the agent is ending,
        or the pool failed: a server with running ranks then ends with the agent)."""
        self.closed = True
        for sb in list(self.standbys):
            self._retire(sb, "stopped")
        for z in [self.zygote, *self.draining]:
            if z is not None and not z.live_served():
                self._note(z, "zygote_stopped", exitcode=z.stop())
        self.zygote, self.draining = None, []
