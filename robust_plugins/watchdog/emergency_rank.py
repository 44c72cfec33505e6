"""The rank side of emergency saves: a registered saver runs when a peer dies, on either backend.

Two ways in, one save (:func:`on_emergency` registers both; whichever comes first runs it, once):

- **exception** (gloo): a collective whose peer died raises on the host ("Connection closed by
  peer"); the uncaught exception's hook runs the save on the main thread's behalf, with SIGTERM
  held off.
- **monitor** (NCCL, or any rank ``ROBUST_EMERGENCY_VIA=monitor`` asks it of): a rank whose peer
  died sees no Python exception. Its host sits in ``.item()`` or a ``synchronize`` behind a
  collective kernel that waits for the dead peer, until NCCL reports an error (torch's agent sets
  ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``: the process is torn down from C++) or the process group
  times out; and work queued on the training stream waits behind that kernel. So the node monitor
  asks instead, as soon as it sees the death
  (:meth:`~robust_plugins.launcher.monitor.emergency.EmergencySaves.hold`),
  and a listener thread of this rank runs the save on a stream of its own, which nothing hung
  orders it behind, while the training thread stays blocked (so nothing changes the state
  meanwhile; no process group is aborted). It saves only state that is provably the last
  reported step's: the device had finished everything queued before that step's ``step_end``
  (a CUDA event recorded there had completed), so that step's update is in memory and no later
  one can be; the saver's own check (DeepSpeed: the engine's step counter equals the reported
  step) covers the host side. Otherwise it records why it did not save. Where NCCL reports the
  peer's death quickly (a network error across nodes), torch's teardown may end the rank first;
  over NVLink NCCL reports nothing and the rank waits for the monitor.

With ``checkpoint.memory_every`` the newest committed in-memory snapshot is the emergency state on
every backend (already in host memory, nothing is copied off a hung device): no saver is
registered then.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

from robust_plugins._logging import get_logger
from robust_plugins.watchdog.client import WAIT_SEND_S, _Client, _device_mark, get_client
from robust_plugins.watchdog.protocol import ENV_EMERGENCY_TIMEOUT, MSG_EMERGENCY, MSG_EMERGENCY_NOW

log = get_logger(__name__)

#: ``auto`` (default: the monitor asks ranks whose collectives move device tensors), ``monitor``
#: (ask this rank whatever its backend: a gloo rank that waits outside collectives) or
#: ``exception`` (never ask; only a failed collective's exception saves).
ENV_VIA = "ROBUST_EMERGENCY_VIA"
VIAS = ("auto", "monitor", "exception")

_emergency: dict[str, Any] = {}
_once = threading.Lock()


def _is_collective_failure(exc: BaseException) -> bool:
    # What a rank sees when a peer died under it: torch's DistError family (DistBackendError,
    # DistNetworkError), or, from older code paths, a RuntimeError naming the transport.
    try:
        import torch.distributed as dist

        if isinstance(exc, getattr(dist, "DistError", ())):
            return True
    except ImportError:
        return False
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        s in text for s in ("Gloo", "gloo", "NCCL", "Connection closed by peer", "Connection reset by peer"))


def requested_via(environ=os.environ) -> str:
    """``ROBUST_EMERGENCY_VIA`` (default ``auto``); an unknown value is an error naming the allowed ones."""
    via = environ.get(ENV_VIA, "auto") or "auto"
    if via not in VIAS:
        from robust_plugins.errors import ConfigError

        raise ConfigError(f"{ENV_VIA} = {via!r} is not one of {', '.join(VIAS)}.")
    return via


def on_emergency(save: Any) -> None:
    """Register ``save(step)``: this rank's emergency checkpoint when a peer dies under it.

    Under ``robust run``, when a peer rank dies, ``save`` is called once with the last step
    reported by :func:`~robust_plugins.watchdog.step_end`, bounded by the watchdog's
    ``emergency_save_timeout_s`` (after which the rank exits anyway): on gloo from the exception
    of the failed collective, before the process exits, with SIGTERM held off; on NCCL when the
    node monitor asks, on a stream of its own (module docstring). The monitor
    waits for it (bounded) before it stops the node's ranks, and records in ``faults.jsonl``
    whether and how (``via``) it happened.

    Only the script knows whether its state then is the state of ``step``: it is when the failing
    collective runs before the optimizer step (a gradient all-reduce does), and only a replicated
    state (plain data parallelism, ZeRO 0) saved from one live rank restores every rank. ``save``
    must not call collectives (the peer is gone) nor synchronize the whole device (a hung kernel
    never finishes: the save would run into its bound). Outside
    ``robust run`` nothing is registered.
    """
    client = get_client()
    if client is None:
        return
    via = requested_via()
    if not _emergency:
        previous = sys.excepthook

        def hook(kind, exc, tb):
            stopped = _is_collective_failure(exc) and _save_on_exception(client)
            previous(kind, exc, tb)
            if stopped:
                # A SIGTERM held during the save: act on it (lost, the agent waited out 30 s).
                os.kill(os.getpid(), signal.SIGTERM)

        sys.excepthook = hook
        if via != "exception" and client.can_ask:
            _emergency["listener"] = _Listener(client)
    _emergency["save"] = save
    # The rank's device, chosen on this (the training) thread; step_end keeps it current. The save
    # runs on other threads, which start on GPU 0.
    client.device, client.step_mark = _device_mark()
    client.mark_steps = True  # step_end records where the device stood (the monitor path's check)
    listener = _emergency.get("listener")
    msg = {"k": MSG_EMERGENCY, "phase": "registered", "via": via if listener is not None else "exception"}
    if listener is not None:
        listener.send(client, msg)  # from the listener's socket: the monitor learns where to ask
    else:
        client.send(msg, wait=True)


class _Listener:
    """A daemon thread on its own datagram socket, where the monitor asks for the save.

    The thread blocks in ``recv`` for the whole life of the rank; the socket's timeout is never
    changed (a timeout set while the thread entered ``recv`` once ended the thread after 10 s
    without an ask, and a later ask went unanswered). Sends wait for room by polling instead."""

    def __init__(self, client: _Client) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("")  # Linux autobind: an abstract address the monitor reads off our datagram
        self._thread = threading.Thread(target=self._loop, args=(client,), name="robust-emergency-listener",
                                        daemon=True)
        self._thread.start()

    def send(self, client: _Client, msg: dict[str, Any]) -> None:
        """Send ``msg`` from this socket, waiting up to ``WAIT_SEND_S`` for room at the monitor."""
        msg.update(r=client.rank, i=client.incarnation, t=time.time())
        data = json.dumps(msg).encode()
        deadline = time.monotonic() + WAIT_SEND_S
        while True:
            try:
                self.sock.sendto(data, socket.MSG_DONTWAIT, client.address)
                return
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(0.01)
                    continue
                exc: OSError = TimeoutError(f"no room at the monitor for {WAIT_SEND_S:g} s")
            except OSError as err:
                exc = err
            log.warning("robust watchdog: rank %d could not register its emergency saver with the node "
                        "monitor (%s)", client.rank, exc)
            return

    def _loop(self, client: _Client) -> None:
        while True:
            try:
                msg = json.loads(self.sock.recv(4096))
            except (ValueError, TimeoutError):
                continue  # not ours; or a timeout someone set on the socket: keep listening
            except OSError:
                return  # the socket is closed
            if msg.get("k") == MSG_EMERGENCY_NOW:
                _save_when_asked(client)


def _claim(client: _Client) -> int | None:
    """The step to save, once per process (the first path to ask wins); None: nothing to save."""
    with _once:
        if _emergency.get("save") is None or client.last_step is None or _emergency.get("done"):
            return None
        _emergency["done"] = True
        return client.last_step


def _save_on_exception(client: _Client) -> bool:
    """The exception path (main thread): the save with SIGTERM held; True if one came meanwhile."""
    step = _claim(client)
    if step is None:
        return False
    # The agent stops the node's ranks with SIGTERM once it sees the dead one: not during the save
    # (it waits for our "done", bounded, and SIGKILLs after its own timeout anyway). Held: an
    # ignored one is gone, and the rank outlives its stop.
    held: list[int] = []
    old = signal.signal(signal.SIGTERM, lambda signum, frame: held.append(signum))
    try:
        _run_save(client, step, "exception")
    finally:
        signal.signal(signal.SIGTERM, old)
    return bool(held)


def _save_when_asked(client: _Client) -> None:
    """The monitor path (listener thread): the save on a stream of its own, if the state is the last
    reported step's (module docstring). SIGTERM cannot be held off a non-main thread; the
    monitor's hold keeps the agent's stop back until "done" instead."""
    step = _claim(client)
    if step is None:
        return
    mark = getattr(client, "step_mark", None)
    if mark is not None and not mark.query():
        why = (f"the device had not finished the work queued before step {step}'s step_end when the peer "
               f"died: that step's update may wait behind the hung collective")
        client.send({"k": MSG_EMERGENCY, "phase": "start", "s": step, "via": "monitor"}, wait=True)
        _report(client, step, "monitor", {"error": why, "skipped": True}, 0.0)
        return
    _run_save(client, step, "monitor", own_stream=True)


def _run_save(client: _Client, step: int, via: str, own_stream: bool = False) -> None:
    """Run the registered save of ``step`` on a bounded worker thread and report it; with
    ``own_stream`` its device work goes on a new stream (no hung kernel ahead of it)."""
    save = _emergency["save"]
    timeout = float(os.environ.get(ENV_EMERGENCY_TIMEOUT, "30") or 30)
    if timeout <= 0:
        return  # emergency_save_timeout_s = 0: turned off
    client.send({"k": MSG_EMERGENCY, "phase": "start", "s": step, "via": via}, wait=True)
    t0 = time.monotonic()
    outcome: dict[str, Any] = {}
    # The training thread's device (recorded at registration and each step_end): this may be the
    # listener thread, whose own current device is GPU 0 whatever the rank's is.
    device = client.device
    # Imported here: the watchdog package imports no torch until a rank uses a device.
    from robust_plugins.device import on_stream, set_thread_device, side_stream

    def run() -> None:
        try:
            set_thread_device(device)
            with on_stream(side_stream(device) if own_stream else None):
                save(step)
            outcome["ok"] = True
        except BaseException as exc:  # reported, then the rank exits as it was going to
            outcome["error"] = repr(exc)
            # A saver that knows it cannot save (checkpoint.emergency.EmergencySkip: a sharded
            # state) says why; that is a decision, not a failure.
            outcome["skipped"] = type(exc).__name__ == "EmergencySkip"

    worker = threading.Thread(target=run, name="robust-emergency-save", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        outcome["error"] = f"timed out after {timeout:g} s (emergency_save_timeout_s)"
    _report(client, step, via, outcome, round(time.monotonic() - t0, 3))


def _report(client: _Client, step: int, via: str, outcome: dict[str, Any], seconds: float) -> None:
    ok = bool(outcome.get("ok"))
    verdict = ("done" if ok else f"skipped ({outcome['error']})" if outcome.get("skipped")
               else "FAILED: " + outcome.get("error", "?"))
    print(f"robust_plugins: rank {client.rank} emergency save of step {step} {verdict} in {seconds} s "
          f"(via {via})", file=sys.stderr, flush=True)
    client.send({"k": MSG_EMERGENCY, "phase": "done", "s": step, "ok": ok, "sec": seconds, "via": via,
                 "error": outcome.get("error")}, wait=True)
