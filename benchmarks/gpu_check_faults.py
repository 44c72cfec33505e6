"""Parts of the one-GPU check (``gpu_check_cuda.py``) for the fault paths on NCCL (issue 30), each
through the package's own entry points: the device other than 0, the overlap's inline side stream,
the flight-recorder hang verdict on a real 1-rank NCCL group with an injected stall, collective
time from the device, RNG per device, the parameter hash, NVML's device, and the emergency path's
save on a stream of its own beside a stalled collective, asked for as the node monitor asks and
run by the rank's own listener thread (:func:`ask_emergency_save`, also run on CPU by
``tests/unit/test_gpu_check_cuda.py``).

Same contract as ``gpu_check_hosts.py``: each part takes the check's context (``device``,
``backend``, ``out``; the 1-rank process group is initialized) and returns ``checks`` (name ->
bool), or raises :class:`~gpu_check_hosts.Skip` with the reason.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from gpu_check_hosts import Skip, _equal, _sync, need, need_cuda

#: ~1 s of ``torch.cuda._sleep`` on a recent GPU (cycles): the injected stall ahead of a collective.
STALL_CYCLES = 2_000_000_000


def ask_emergency_save(out: str, save: Callable[[int], None], step: int = 7,
                       before_ask: Callable[[], None] | None = None, timeout_s: float = 60.0) -> dict:
    """Drive the package's NCCL emergency path as ``robust run`` does, in this process: its real
    watchdog client (on a socket this function plays the node monitor on), ``watchdog.on_emergency``
    and ``watchdog.step_end`` on the calling (training) thread, then the monitor's ask, which the
    rank's listener thread answers by running ``save`` on its save thread. Returns the rank's
    ``done`` report with ``asked_s`` (ask to report). Runs on CPU too (the save then has no device).
    """
    from robust_plugins import watchdog
    from robust_plugins.watchdog import client as client_mod, emergency_rank, protocol

    env = {protocol.ENV_RUN_DIR: out, protocol.ENV_INCARNATION: "0", emergency_rank.ENV_VIA: "monitor",
           protocol.ENV_EMERGENCY_TIMEOUT: str(timeout_s)}
    saved_env = {k: os.environ.get(k) for k in env}
    saved_client = (client_mod._client, client_mod._checked)
    saved_hook, saved_emergency = sys.excepthook, dict(emergency_rank._emergency)
    with tempfile.TemporaryDirectory() as tmp:
        monitor = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        monitor.bind(os.path.join(tmp, "monitor.sock"))
        monitor.settimeout(timeout_s)
        os.environ.update(env)
        emergency_rank._emergency.clear()
        try:
            client = client_mod._Client(os.path.join(tmp, "monitor.sock"))
            client.fr_served = True  # the flight part serves the recorder; not this one's concern
            client_mod._client, client_mod._checked = client, True

            def until(pred):
                while True:
                    data, addr = monitor.recvfrom(1 << 16)
                    msg = json.loads(data)
                    if pred(msg):
                        return msg, addr

            watchdog.on_emergency(save)
            _, listener = until(lambda m: m.get("phase") == "registered")
            watchdog.step_end(step)  # the training thread's step: where the device stood
            if before_ask is not None:
                before_ask()
            t0 = time.perf_counter()
            monitor.sendto(json.dumps({"k": protocol.MSG_EMERGENCY_NOW}).encode(), listener)
            done, _ = until(lambda m: m.get("phase") == "done")
            return {**done, "asked_s": time.perf_counter() - t0}
        finally:
            listener_obj = emergency_rank._emergency.get("listener")
            if listener_obj is not None:
                listener_obj.sock.close()  # ends the listener thread
            emergency_rank._emergency.clear()
            emergency_rank._emergency.update(saved_emergency)
            sys.excepthook = saved_hook
            if client_mod._client is not None and client_mod._client is not saved_client[0]:
                client_mod._client.sock.close()
            client_mod._client, client_mod._checked = saved_client
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            monitor.close()


def part_device(ctx: dict) -> dict:
    """Work the package starts on its own threads lands on the rank's device, not GPU 0: the
    emergency save that the listener thread runs when the node monitor asks, through the
    package's own entry points (:func:`ask_emergency_save`)."""
    need_cuda()
    dev = ctx["device"]
    if torch.cuda.device_count() < 2:
        raise Skip("one GPU: every device is cuda:0, so a missing set_device or a device index taken "
                   "from the global rank cannot show")
    seen = {}

    def save(step: int) -> None:
        seen.update(thread=threading.current_thread().name, device=torch.cuda.current_device(),
                    side_stream=torch.cuda.current_stream() != torch.cuda.default_stream())

    done = ask_emergency_save(str(ctx["out"]), save)
    return {"device": str(dev), "seen": seen, "report": done,
            "checks": {"check runs on a device other than 0": dev.index != 0,
                       "the save ran on the package's save thread": seen.get("thread") == "robust-emergency-save",
                       "on the rank's device": seen.get("device") == dev.index,
                       "on a stream of its own": seen.get("side_stream") is True,
                       "reported done": done.get("ok") is True}}


def part_overlap(ctx: dict) -> dict:
    """The overlapped sync on CUDA runs inline onto a side stream (no thread), over the host's own
    NCCL group (no clone), bitwise equal to the synchronous reduction."""
    need_cuda()
    from robust_plugins.comm import compressed_all_reduce
    from robust_plugins.comm.overlap import SyncThread, clone_groups

    dev = ctx["device"]
    x = torch.randn(1 << 22, device=dev)
    want = compressed_all_reduce(x.clone(), codec="int8", op="sum")
    threads = threading.active_count()
    sync = SyncThread("gpu-check-sync", "gpu check bucket", device=dev)
    clones = clone_groups([dist.group.WORLD])
    got = x.clone()
    handle = sync.submit("b0", lambda: compressed_all_reduce(got, codec="int8", op="sum"), [got])
    handle.wait(60)
    _sync()
    sync.close()
    return {"checks": {"inline on CUDA": sync.inline and threading.active_count() == threads,
                       "no clone of the NCCL group": clones[id(dist.group.WORLD)] is dist.group.WORLD,
                       "bitwise equal to the synchronous reduction": _equal(got, want)}}


def part_flight(ctx: dict) -> dict:
    """A real NCCL flight-recorder dump read through torch's worker server while a collective is
    stalled behind a long kernel: the view the hang verdict uses, and the verdict against a peer
    that never issued it."""
    need_cuda()
    from robust_plugins.watchdog import detect, flight

    dev = ctx["device"]
    path = flight.serve(str(ctx["out"]), 0)
    if path is None:
        raise Skip("this torch cannot serve its flight recorder (see the log)")
    x = torch.ones(1 << 20, device=dev)
    for _ in range(3):
        dist.all_reduce(x)
    _sync()
    torch.cuda._sleep(STALL_CYCLES)  # the injected stall: the next collective waits behind it
    dist.all_reduce(x)
    t0 = time.perf_counter()
    dumps = flight.fetch(path)
    fetch_s = time.perf_counter() - t0
    _sync()
    if not dumps:
        return {"checks": {"flight recorder answered": False}}
    view = detect.group_view(dumps)
    mine = [g for k, g in view.items() if k.startswith("nccl:")]
    # A made-up second rank that never issued the stalled collective: the verdict must name it.
    behind = {k: detect.GroupSeq(members=g.members, enqueued=g.enqueued - 1, completed=g.enqueued - 1)
              for k, g in view.items()}
    where = detect.localize_by_sequence({0: view, 1: behind})
    return {"labels": sorted(dumps), "view": {k: vars(g) for k, g in view.items()}, "fetch_s": fetch_s,
            "checks": {"flight recorder answered during the stall": fetch_s < 5.0,
                       "the default group by name and members": any(g.members == [0] for g in mine),
                       "the stalled collective is pending": any(g.waiting and g.enqueued >= 4 for g in mine),
                       "a peer that did not issue it is named stuck": where is not None and where.stuck == [1]}}


def part_wire_async(ctx: dict) -> dict:
    """Collective time from the device: an ``async_op`` collective and a coalesced pair are timed to
    their completion, not as their launch, and reading right after the launch does not wait."""
    need_cuda()
    from torch.distributed.distributed_c10d import _coalescing_manager

    from robust_plugins.comm import WireCounter

    dev = ctx["device"]
    # One rank: NCCL's all-gather is a device copy of 1 GB (a measurable time; an in-place
    # all-reduce of one rank moves nothing).
    src = torch.ones(1 << 28, device=dev)
    dst = torch.empty_like(src)
    dist.all_gather_into_tensor(dst, src)
    _sync()
    with WireCounter(timing_only=True) as sync_wc:
        dist.all_gather_into_tensor(dst, src)
    sync_s = sync_wc.seconds
    with WireCounter(timing_only=True) as async_wc:
        torch.cuda._sleep(STALL_CYCLES)  # the collective waits behind it: still running when read
        work = dist.all_gather_into_tensor(dst, src, async_op=True)
        t0 = time.perf_counter()
        at_launch = async_wc.settled_seconds()
        read_s = time.perf_counter() - t0
        work.wait()
        _sync()
    half = src.numel() // 2
    with WireCounter(timing_only=True) as coal_wc:
        with _coalescing_manager(async_ops=True) as cm:
            dist.all_gather_into_tensor(dst[:half], src[:half], async_op=True)
            dist.all_gather_into_tensor(dst[half:], src[half:], async_op=True)
        cm.wait()
        _sync()
    a, c = async_wc.seconds, coal_wc.seconds
    return {"sync_s": sync_s, "async_s": a, "coalesced_s": c, "settled_at_launch_s": at_launch, "read_s": read_s,
            "checks": {"async timed to completion (> half the sync time)": a > 0.5 * sync_s > 0,
                       "coalesced timed to completion": c > 0.5 * sync_s,
                       "reading at launch did not wait for the device": at_launch == 0.0 and read_s < 0.1}}


def part_rng(ctx: dict) -> dict:
    """RNG state of the rank's own device: saved, restored, replayed; the HF binding uses it too."""
    need_cuda()
    from robust_plugins.device import device_rng_state, set_device_rng_state

    dev = ctx["device"]
    state = device_rng_state()
    a = torch.randn(1000, device=dev)
    set_device_rng_state(state)
    b = torch.randn(1000, device=dev)
    checks = {"state of the current device": state is not None and _equal(state, torch.cuda.get_rng_state(dev)),
              "replay after restore": _equal(a, b)}
    try:
        need("transformers")
    except Skip as why:
        return {"hf": str(why), "checks": checks}
    from robust_plugins.patches import transformers_trainer as tt

    hf = tt._rng_states()
    checks["HF binding saves one device's state"] = _equal(hf["cuda"], torch.cuda.get_rng_state(dev))
    return {"checks": checks}


def part_param_hash(ctx: dict) -> dict:
    """The SDC check's parameter hash computed on the device equals itself across copies and
    changes with one flipped bit."""
    need_cuda()
    from robust_plugins.watchdog.param_hash import param_hash

    dev = ctx["device"]
    params = [torch.randn(1 << 20, device=dev), torch.randn(333, device=dev)]
    same = [p.clone() for p in params]
    flipped = [p.clone() for p in params]
    flipped[1].view(torch.int32)[7] ^= 1
    h = param_hash(params)
    return {"hash": h, "checks": {"equal copies hash equal": h == param_hash(same),
                                  "one bit changes it": h != param_hash(flipped)}}


def part_nvml(ctx: dict) -> dict:
    """NVML is asked about the rank's current device by its PCI address."""
    need_cuda()
    nvml = need("pynvml")
    from robust_plugins.topology.sources import current_gpu_bus_id

    bus = current_gpu_bus_id()
    nvml.nvmlInit()
    try:
        handle = nvml.nvmlDeviceGetHandleByPciBusId(bus)
        got = nvml.nvmlDeviceGetPciInfo(handle).busId
        got = got.decode() if isinstance(got, bytes) else str(got)
    finally:
        nvml.nvmlShutdown()
    return {"bus_id": bus, "nvml_bus_id": got,
            "checks": {"NVML's device is the current CUDA device": got.upper().endswith(bus[-12:].upper())}}


def part_stream_save(ctx: dict) -> dict:
    """The NCCL emergency path's save, asked by the node monitor and run by the rank's listener
    thread (:func:`ask_emergency_save`: the package's client, listener and save threads), copies
    the state off the device on a stream of its own while a collective is stalled ahead of it on
    the training stream."""
    need_cuda()
    dev = ctx["device"]
    state = torch.randn(1 << 24, device=dev)
    want = state.cpu()
    saved = {}

    def stall() -> None:  # after the step's mark: the training stream and a collective behind it
        torch.cuda._sleep(4 * STALL_CYCLES)  # ~4 s
        dist.all_reduce(torch.ones(1 << 20, device=dev))

    def save(step: int) -> None:
        saved.update(step=step, copy=state.cpu(), device=torch.cuda.current_device())

    done = ask_emergency_save(str(ctx["out"]), save, before_ask=stall)
    _sync()
    took = done.get("asked_s", float("inf"))
    return {"save_s": took, "report": done,
            "checks": {"saved while the stall lasted (< 2 s of ~4 s)": done.get("ok") is True and took < 2.0,
                       "the copy is the state": "copy" in saved and _equal(saved["copy"], want),
                       "on the rank's device": saved.get("device") == dev.index}}


PARTS = {"device": part_device, "overlap": part_overlap, "flight": part_flight, "wire_async": part_wire_async,
         "rng": part_rng, "param_hash": part_param_hash, "nvml": part_nvml, "stream_save": part_stream_save}
