"""The rank side of the watchdog: step signals to the node monitor, fault injection, stack dumps.

Injected faults fire in :mod:`.inject_rank` (:class:`~.inject_rank.RankInjections`, which the client
owns); a step with none armed costs one check here.

Every step goes into this rank's shared-memory ring (:mod:`.ring`; its path prefix in
``ROBUST_WATCHDOG_RING``), which the monitor reads when it polls: a step costs a record written
to memory, no system call and no wake-up of the monitor. Rare events go as single datagrams on a
Unix socket the monitor binds (``ROBUST_WATCHDOG_SOCKET``): the rank's hello, a NaN/Inf loss or
gradient norm (also in the ring; the datagram makes it immediate and unlosable), injected
faults, parameter hashes, ``ok_to_save`` questions, emergency saves, the rank's exit. If the
monitor is gone, datagrams are dropped, ring records go unread, and training goes on: a warning is
logged once (a failed send, or a monitor heartbeat in the ring older than
``MONITOR_STALE_S``). Outside ``robust run`` the variables are unset and every call returns at once.

On first use a rank also
- registers :mod:`faulthandler` on SIGUSR1, writing to ``<run_dir>/stacks/``, the fallback the
  monitor uses when py-spy cannot read the rank's stack;
- asks the kernel to SIGKILL it if the launcher dies (``PR_SET_PDEATHSIG``), so no rank outlives
  ``robust run`` even when the launcher itself is SIGKILLed.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import faulthandler
import json
import math
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from robust_plugins._logging import get_logger, warn_once
from robust_plugins.errors import ConfigError, UnsupportedError
from robust_plugins.watchdog import flight as _flight
from robust_plugins.watchdog import hold as _hold
from robust_plugins.watchdog import inject_rank as _inject_rank
from robust_plugins.watchdog.detect import WARM_INTERVALS
from robust_plugins.watchdog.param_hash import hash_message, minority_ranks, param_hash  # noqa: F401  (tests name it here)
from robust_plugins.watchdog.protocol import (
    ENV_INCARNATION,
    ENV_INJECT,
    ENV_LAUNCH_WORLD,
    ENV_RING,
    ENV_RUN_DIR,
    ENV_SDC_EVERY,
    ENV_SKIP,
    ENV_SOCKET,
    ENV_SPIKE,
    ENV_SPIKE_WINDOWS,
    ENV_STRAGGLER,
    MSG_BAD,
    MSG_COMM,
    MSG_END,
    MSG_EXIT,
    MSG_GROUP,
    MSG_HELLO,
    MSG_HISTORY,
    MSG_QUERY,
    MSG_REFUSED,
    MSG_VERDICT,
    parse_skip_steps,
    ring_path,
)
from robust_plugins.watchdog.ring import RingError, RingWriter

log = get_logger(__name__)

#: A check sends every rank's hash (the evidence) up to this many ranks (16 bytes each; a unix
#: datagram holds ~200 KB, but a short one is read without a second copy).
MAX_HASHES_SENT = 256

_PR_SET_PDEATHSIG = 1

#: A rank warns once when the monitor's heartbeat in its ring is older than this: the monitor
#: stopped reading (it polls every ~0.1 s; a hang's stack collection holds it up to
#: ``stack_dump_timeout_s``, 15 s by default, and an emergency-save wait up to 30 s).
MONITOR_STALE_S = 60.0

#: How long a message the monitor must not miss (a fault's announcement, an emergency save's
#: registration, start and end) waits for room in the monitor's queue, which holds only
#: ``net.unix.max_dgram_qlen`` datagrams (10 by default): a starved agent can leave it full for
#: seconds. Step signals never wait (the next one supersedes a dropped one).
WAIT_SEND_S = 10.0

#: How often (seconds of steps) a rank looks at the monitor's heartbeat.
HEARTBEAT_CHECK_S = 1.0


class _Client:
    def __init__(self, address: str) -> None:
        self.address = address
        self.rank = int(os.environ.get("RANK", "0"))
        self.incarnation = int(os.environ.get(ENV_INCARNATION, "0"))
        self.sdc_every = int(os.environ.get(ENV_SDC_EVERY, "0") or 0)
        self.time_comm = os.environ.get(ENV_STRAGGLER, "0") == "1"
        self.comm = None
        """A WireCounter open for the process's life (straggler detector on): seconds inside
        torch.distributed collectives, to split each step into compute and waiting."""
        self.last_step: int | None = None
        self.last_end: float | None = None
        self.last_comm_s = 0.0
        self.skip_steps = parse_skip_steps(os.environ.get(ENV_SKIP, ""))
        self.injections = _inject_rank.RankInjections(
            self.rank, os.environ.get(ENV_INJECT) or None, self.skip_steps, self.send)
        self.spikes = _hold.SpikeWatch(os.environ.get(ENV_SPIKE, ""), os.environ.get(ENV_SPIKE_WINDOWS, ""),
                                       self.rank, self.incarnation)
        self.step_times: list[float] = []
        """This rank's latest step times (the learned hang timeout's input), for checkpoints."""
        self.intervals = 0
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        # An abstract address of the kernel's choosing (Linux autobind) so the monitor can answer
        # ok_to_save; elsewhere the socket stays unbound and ok_to_save cannot ask.
        self.can_ask = sys.platform.startswith("linux")
        if self.can_ask:
            self.sock.bind("")
        self.dropped = 0
        self.ring = self._open_ring()
        self._next_beat_check = 0.0
        self.fh_path = self._register_faulthandler()
        self.fr_served = False
        self.mark_steps = False
        """An emergency saver is registered: each step_end records where the device stood."""
        self.step_mark = None
        """The CUDA event recorded at the last step_end (``mark_steps``; None on CPU)."""
        self.device = None
        """The training thread's current CUDA device, recorded with ``step_mark`` and at a
        saver's registration (None on CPU): the device an emergency save on another thread uses."""
        self.params_refused: str | None = None
        """Why :func:`check_params` cannot serve this rank's parameters, or None: set by a host
        binding whose parameters have no replica (``patches/deepspeed_watchdog.py``, ZeRO-3);
        :func:`check_params` then raises with it instead of hashing them."""
        _die_with_parent()
        # Waits (bounded) for room: the monitor learns the faulthandler file from it, and removes
        # the ring's file name once the rank has mapped it.
        self.send({"k": MSG_HELLO, "pid": os.getpid(), "fh": self.fh_path, "ring": self.ring is not None},
                  wait=True)
        atexit.register(self._bye)

    def _open_ring(self) -> RingWriter | None:
        prefix = os.environ.get(ENV_RING)
        if not prefix:
            return None  # a monitor without rings (it logged why): a datagram a step
        path = ring_path(prefix, self.rank)
        try:
            return RingWriter(path)
        except (OSError, RingError) as exc:
            log.warning("robust watchdog: rank %d cannot map its step ring %s (%s); it sends a "
                        "datagram a step instead, which costs more per step on busy cores.",
                        self.rank, path, exc)
            return None

    def _register_faulthandler(self) -> str | None:
        run_dir = os.environ.get(ENV_RUN_DIR)
        if not run_dir or not hasattr(signal, "SIGUSR1"):
            return None
        path = Path(run_dir) / "stacks" / f"faulthandler-rank{self.rank}-pid{os.getpid()}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        # Kept open for the life of the process: faulthandler writes from a signal handler.
        self._fh_file = open(path, "a")
        faulthandler.register(signal.SIGUSR1, file=self._fh_file, all_threads=True, chain=False)
        return str(path)

    def send(self, msg: dict[str, Any], wait: bool = False) -> None:
        """Send one signal. ``wait=False`` never blocks: if the monitor's buffer is full the
        datagram is dropped (the next step's signal supersedes it). ``wait=True`` (fault
        announcements) waits up to :data:`WAIT_SEND_S` for buffer space."""
        msg["r"] = self.rank
        msg["i"] = self.incarnation
        msg["t"] = time.time()
        data = json.dumps(msg).encode()
        try:
            if wait:
                self.sock.settimeout(WAIT_SEND_S)
                try:
                    self.sock.sendto(data, self.address)
                finally:
                    self.sock.setblocking(True)
            else:
                self.sock.sendto(data, socket.MSG_DONTWAIT, self.address)
        except BlockingIOError:
            self.dropped += 1
            warn_once(log, "watchdog-behind", "robust watchdog: the node monitor is behind; step "
                      "signals are being dropped (harmless unless it persists).")
        except OSError as exc:
            warn_once(log, "watchdog-send", "robust watchdog: cannot reach the node monitor at %s "
                      "(%s); training goes on without fault detection.", self.address, exc)

    def _bye(self) -> None:
        # At interpreter exit: the monitor stops expecting steps from this rank. Silent when the
        # monitor is gone (the job is over).
        try:
            self.sock.sendto(json.dumps({"k": MSG_EXIT, "r": self.rank, "i": self.incarnation,
                                         "t": time.time()}).encode(), socket.MSG_DONTWAIT, self.address)
        except OSError:
            pass

    def step_end(self, step: int, loss: float | None, grad_norm: float | None) -> None:
        if step == self.last_step:
            return  # the same step reported twice (the engine's signal and the script's): once
        self.last_step = step
        if self.time_comm and self.comm is None:
            self._open_comm_timer()
        if not self.fr_served:  # at the first step, once the host built its process group
            self.fr_served = True
            kind = _flight.collective_device_type()
            if kind is not None:  # the monitor's hang verdict: do collectives block the host?
                self.send({"k": MSG_COMM, "dev": kind}, wait=True)
            _flight.serve_if_needed(os.environ.get(ENV_RUN_DIR), self.rank)
        if self.injections.due:  # one check a step when nothing is armed
            loss, grad_norm = self.injections.fire_at_step(step, loss, grad_norm)
        # CLOCK_MONOTONIC: one clock for every process of the host, so the monitor can use the
        # step-end time written here as the time of progress.
        now = time.monotonic()
        wall = comm = None
        if self.last_end is not None:
            wall = now - self.last_end  # since the previous step's end
            self.intervals += 1
            if self.intervals > WARM_INTERVALS:  # as the monitor learns (detect.WARM_INTERVALS)
                self.step_times.append(wall)
                del self.step_times[:-STEP_TIMES_KEPT]
            if self.comm is not None:
                # Of which inside collectives, as far as the device has finished them: read
                # without waiting (a collective still running counts in a later step).
                comm = self.comm.settled_seconds() - self.last_comm_s
        self.last_end = now
        if self.mark_steps:
            self.device, self.step_mark = _device_mark()
        if self.comm is not None:
            self.last_comm_s = self.comm.settled_seconds()
        bad = any(v is not None and not math.isfinite(v) for v in (loss, grad_norm))
        if self.ring is not None:
            self.ring.write(step, loss, grad_norm, wall, comm, now)
            if bad:
                # The fault itself: also a datagram (waiting, bounded, for room in the queue), so
                # it reaches the monitor even if the ring were lapped before the next poll.
                self.send({"k": MSG_BAD, "s": step, "l": loss, "g": grad_norm}, wait=True)
            if now >= self._next_beat_check:
                self._check_monitor(now)
        else:
            msg: dict[str, Any] = {"k": MSG_END, "s": step, "l": loss, "g": grad_norm}
            if wall is not None:
                msg["w"] = wall
                if comm is not None:
                    msg["c"] = comm
            # A plain step's signal may be dropped when the monitor is behind (the next one
            # supersedes it), but a NaN/Inf is the fault itself: the queue holds only
            # net.unix.max_dgram_qlen (10) datagrams, so under load it must wait for room (bounded).
            self.send(msg, wait=bad)
        if bad or self.spikes.seen(loss, grad_norm):
            _hold.after_fault(self, step, "NaN/Inf" if bad else "spike")

    def _check_monitor(self, now: float) -> None:
        self._next_beat_check = now + HEARTBEAT_CHECK_S
        beat = self.ring.monitor_heartbeat()
        if beat is not None and now - beat > MONITOR_STALE_S:
            warn_once(log, "watchdog-stale", "robust watchdog: the node monitor has not read rank %d's "
                      "step ring for %.0f s; training goes on, but hangs, NaN/Inf, spikes and "
                      "stragglers are not being detected.", self.rank, now - beat)

    def _open_comm_timer(self) -> None:
        # Opened at the first step, after the host built its communication backend (DeepSpeed
        # binds two collectives at start-up, which WireCounter finds only if they exist by then).
        # Host time for CPU tensors (gloo's calls block); CUDA events for CUDA tensors (NCCL's
        # calls return at launch): robust_plugins/timing.py.
        try:
            from robust_plugins.comm.wire import WireCounter

            # Only the time inside collectives is needed: skipping the argument binding of byte
            # counting cut the added cost per call from ~21 to ~2 us (watchdog_bench.rank_side_cost).
            self.comm = WireCounter(timing_only=True).__enter__()
        except Exception as exc:  # never take training down for a detector
            self.time_comm = False
            warn_once(log, "watchdog-comm-timer", "robust watchdog: cannot time collectives (%r); "
                      "the straggler detector is off for this rank.", exc)


    def check_params(self, step: int, params: list, group: Any) -> bool:
        if self.sdc_every <= 0 or step % self.sdc_every:
            return True
        import torch
        import torch.distributed as dist

        if self.injections.params:
            self.injections.fire_param_fault(step, params)
        from robust_plugins.device import collective_device

        mine = param_hash(params)
        mine_t = torch.tensor([mine], dtype=torch.int64, device=collective_device(group))
        world = dist.get_world_size(group)
        gathered = [torch.empty_like(mine_t) for _ in range(world)]
        dist.all_gather(gathered, mine_t, group=group)
        hashes = {dist.get_global_rank(group, i) if group is not None else i: int(t.item())
                  for i, t in enumerate(gathered)}
        msg = hash_message(step, mine, hashes, max_sent=MAX_HASHES_SENT)
        # Waited for, unlike a step signal: a dropped hash is missing evidence (a replay's
        # verdict counts them), and it comes only every sdc_every_steps steps.
        self.send(msg, wait=True)
        return not msg["why"]


    def ok_to_save(self, step: int, timeout_s: float) -> bool:
        if not self.can_ask:
            warn_once(log, "watchdog-ask", "robust watchdog: ok_to_save needs Linux; saving unchecked.")
            return True
        ok = self.ask(step, timeout_s)
        if ok is None:
            log.warning("robust watchdog: no answer from the node monitor about step %d within "
                        "%.0f s; saving without its check.", step, timeout_s)
        return ok is not False

    def ask(self, step: int, timeout_s: float) -> bool | None:
        """The monitor's verdict on ``step`` (False: a fault was found and the ranks are being
        stopped); None without an answer within ``timeout_s`` or where the rank cannot ask."""
        if not self.can_ask:
            return None
        self.send({"k": MSG_QUERY, "s": step}, wait=True)
        deadline = time.monotonic() + timeout_s
        try:
            while (left := deadline - time.monotonic()) > 0:
                self.sock.settimeout(left)
                msg = json.loads(self.sock.recv(4096))
                if msg.get("k") == MSG_VERDICT and msg.get("s") == step:
                    return bool(msg["ok"])
        except (socket.timeout, OSError, ValueError):
            return None
        finally:
            self.sock.setblocking(True)
        return None


#: Step times a rank keeps for its checkpoints (the monitor's window per rank).
STEP_TIMES_KEPT = 512

#: ``state_dict`` format version.
STATE_FORMAT = 1


def state_dict() -> dict[str, Any]:
    """The watchdog's learned state on this rank, to save with a checkpoint: its latest step times,
    from which the monitor learns the hang timeout. Empty outside ``robust run``.

    A job relaunched by a new ``robust run`` (a new launcher, whose monitor knows nothing) that
    passes the loaded dict to :func:`load_state_dict` gets its learned timeout back at once instead
    of the long ``hang_initial_timeout_s`` of a warm-up. Plain data: lists of floats, safe for
    ``torch.load(weights_only=True)``. DeepSpeed engines with a ``robust_plugins`` block do both
    calls themselves (in ``client_state`` under ``"robust_watchdog"``).
    """
    c = get_client()
    if c is None:
        return {}
    return {"format": STATE_FORMAT, "step_times": list(c.step_times)}


def load_state_dict(state: dict[str, Any] | None) -> None:
    """Hand step times saved by :func:`state_dict` to this rank and to the node monitor, which
    uses them for the learned hang timeout if it has learned none itself (a fresh launcher).
    Call it on every rank after loading a checkpoint; a no-op outside ``robust run`` or for an
    empty dict."""
    c = get_client()
    if c is None or not state:
        return
    if state.get("format") != STATE_FORMAT:
        log.warning("robust watchdog: ignoring saved watchdog state of format %r (expected %d).",
                    state.get("format"), STATE_FORMAT)
        return
    times = [float(t) for t in state.get("step_times", [])][-STEP_TIMES_KEPT:]
    c.step_times = (times + c.step_times)[-STEP_TIMES_KEPT:]
    # One datagram; 512 floats as JSON fit far below the 64 KiB the monitor reads.
    c.send({"k": MSG_HISTORY, "times": times}, wait=True)


def _device_mark():
    """This thread's current CUDA device and an event on its current stream, recorded now (no
    wait); (None, None) without CUDA."""
    from robust_plugins.device import current_stream, record_event, thread_device

    device = thread_device()
    return device, record_event(current_stream(device))


def _die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        warn_once(log, "watchdog-pdeathsig", "robust watchdog: prctl(PR_SET_PDEATHSIG) unavailable; "
                  "ranks may outlive a killed launcher.")


_client: _Client | None = None
_checked = False


def get_client() -> _Client | None:
    """The process's client, created on first use; ``None`` outside ``robust run``."""
    global _client, _checked
    if not _checked:
        _checked = True
        address = os.environ.get(ENV_SOCKET)
        if address:
            _client = _Client(address)
    return _client


#: A refusal's text is cut to this many characters (a datagram, and one line of faults.jsonl).
REFUSAL_CHARS = 4000


def refused(exc: BaseException) -> None:
    """Tell ``robust run``'s node monitor that ``exc`` (a :class:`ConfigError` or
    :class:`UnsupportedError`) refuses this job before the rank's first step: the launcher then
    ends the job with its message instead of restarting into the same refusal. After the first
    step, and outside ``robust run``, it does nothing (a later error is a fault like any other)."""
    client = get_client()
    if client is None or client.last_step is not None:
        return
    client.send({"k": MSG_REFUSED, "why": f"{type(exc).__name__}: {exc}"[:REFUSAL_CHARS]}, wait=True)


@contextlib.contextmanager
def final_refusals() -> Iterator[None]:
    """Around the plugin's entry points (``deepspeed.initialize``, ``rpm.enable``): a
    :class:`ConfigError` or :class:`UnsupportedError` raised inside goes to :func:`refused`, then on."""
    try:
        yield
    except (ConfigError, UnsupportedError) as exc:
        refused(exc)
        raise


def _as_float(value: Any) -> float | None:
    if value is None:
        return None
    if hasattr(value, "item"):
        value = value.item()
    return float(value)


def step_end(step: int, loss: Any = None, grad_norm: Any = None) -> None:
    """Tell the node monitor that this rank finished optimizer step ``step``.

    ``loss`` and ``grad_norm`` (floats or 0-d tensors, optional) feed the NaN/Inf detector; a
    tensor is read with ``.item()``, which waits for the device. Call it once a step, after the
    optimizer step, with a step number that a resumed run continues (the checkpointed step + 1,
    ...). Outside ``robust run`` it does nothing.
    """
    client = get_client()
    if client is None:
        return
    client.step_end(int(step), _as_float(loss), _as_float(grad_norm))


def straggler_group(name: str) -> None:
    """Have the straggler detector compare this rank's compute time with the ranks that said the
    same ``name`` only (by default every rank of its node is compared with all the others). For
    ranks that do different work: each pipeline stage is a group (megatron-core's front doors say
    so themselves). Call it once, on every rank, before training; outside ``robust run`` it does
    nothing."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"watchdog.straggler_group(name={name!r}): the name must be a non-empty string "
                          f"(a pipeline stage: e.g. 'pp0').")
    client = get_client()
    if client is not None:
        client.send({"k": MSG_GROUP, "g": name}, wait=True)  # once: worth waiting for room


def check_params(step: int, params: Any, group: Any = None) -> bool:
    """Compare a 64-bit hash of this rank's parameters with every other replica's (silent data
    corruption); returns False when some replica differs (do not save a checkpoint then).

    Call it on every rank of ``group`` (a data-parallel group whose replicas hold identical
    parameters; default: the whole job) after the optimizer step, *before* saving a checkpoint.
    It works every ``sdc_every_steps`` steps (watchdog setting) and returns True at once on the
    others; one check costs one pass over the parameters and an 8-byte all-gather. A mismatch is
    reported to the node monitor, which records an ``sdc`` fault naming the minority ranks and
    rolls the job back to the newest checkpoint. Outside ``robust run`` it does nothing.
    ``params``: a module or a list of tensors (in the same order on every rank).
    """
    client = get_client()
    if client is None:
        return True
    if client.params_refused is not None:
        raise UnsupportedError(f"robust_plugins.watchdog.check_params: {client.params_refused}. Remove the call.")
    if client.sdc_every <= 0 or int(step) % client.sdc_every:
        return True  # before listing the parameters: most steps are not check steps
    tensors = list(params.parameters()) if hasattr(params, "parameters") else list(params)
    return client.check_params(int(step), tensors, group)


def skip_batch(step: int) -> bool:
    """True when the batch of step ``step`` must be skipped: under ``robust run`` that step spiked
    again after a rollback (``spike_skip_batch``), so its batch, not a transient fault, is the
    cause. Every rank gets the same answer. Outside ``robust run`` it returns False.

    Skipping is the script's move, because only it knows its data. A loop that indexes data by step
    keeps the step numbering and takes no optimizer step for that batch::

        if watchdog.skip_batch(step):
            watchdog.step_end(step)   # progress, without a loss
            continue
    """
    if os.environ.get(ENV_SOCKET) is None:
        return False
    return int(step) in parse_skip_steps(os.environ.get(ENV_SKIP, ""))


#: How long ``ok_to_save`` waits for the monitor (it answers within a monitor interval once every
#: rank reported the step; longer only when a rank is stuck, and then saving is harmless).
OK_TO_SAVE_TIMEOUT_S = 10.0


def ok_to_save(step: int, timeout_s: float = OK_TO_SAVE_TIMEOUT_S) -> bool:
    """Ask the node monitor whether a checkpoint of step ``step`` may be written.

    Faults are detected in the monitor, a little after the step that caused them; a script that
    saves in between would write the NaN, the spike's update or the corrupted replica into the
    checkpoint the rollback then loads. The monitor answers once every rank of the node has
    reported ``step`` (usually within one monitor interval, ~0.1 s, so ask only at save steps):
    False if a fault was found, True otherwise. After ``timeout_s`` without an answer it warns
    and returns True. Outside ``robust run`` it returns True at once. Savers that call a
    collective (DeepSpeed ``save_checkpoint``) get the same answer on every rank of the node,
    unless a fault is found between their questions, and then the job is being restarted anyway.
    """
    client = get_client()
    if client is None:
        return True
    return client.ok_to_save(int(step), timeout_s)


def grad_accumulation(global_batch: int, micro_batch: int, world_size: int | None = None) -> int:
    """Micro-batches per optimizer step that keep ``global_batch`` samples a step at this world size.

    Under ``robust run --nnodes MIN:MAX`` a job can continue on fewer (or more) nodes; a script
    that sizes its accumulation with this call keeps the global batch, and with data indexed by
    step and sample (the resume contract) trains on the same samples per step as before. Rank 0
    says so on stderr when the world size differs from the job's first incarnation. ``world_size``
    defaults to ``WORLD_SIZE`` (1 when unset). Raises :class:`ConfigError` when ``global_batch``
    is not a multiple of ``micro_batch`` x the world size: then no accumulation keeps it, and
    silently changing the global batch would change the training.
    """
    world = int(world_size if world_size is not None else os.environ.get("WORLD_SIZE", "1"))
    for name, value in (("global_batch", global_batch), ("micro_batch", micro_batch), ("world size", world)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"grad_accumulation: {name} = {value!r} must be an integer >= 1.")
    if global_batch % (micro_batch * world):
        raise ConfigError(
            f"grad_accumulation: global batch {global_batch} is not a multiple of micro batch "
            f"{micro_batch} x world size {world}; no gradient accumulation keeps it. Choose a global "
            f"batch divisible by micro_batch x every world size the job may run at (--nnodes MIN:MAX "
            f"x --nproc-per-node)."
        )
    accum = global_batch // (micro_batch * world)
    launch = os.environ.get(ENV_LAUNCH_WORLD)
    if int(os.environ.get("RANK", "0")) == 0 and launch and launch.isdigit() and int(launch) != world:
        was = int(launch)
        before = (f"{global_batch // (micro_batch * was)}"
                  if global_batch % (micro_batch * was) == 0 else "n/a")
        print(f"robust_plugins: world size {world} (the job started at {was}): gradient accumulation "
              f"{accum} (was {before}) keeps the global batch of {global_batch} samples "
              f"({micro_batch} a micro-batch)", file=sys.stderr, flush=True)
    return accum
