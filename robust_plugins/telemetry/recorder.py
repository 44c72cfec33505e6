"""The per-engine telemetry recorder: host-agnostic, fed by a host integration.

A host integration (``patches/deepspeed.py``) calls, on every rank:

- :meth:`Telemetry.count_tokens` from a forward pre-hook (training forwards only),
- :meth:`Telemetry.grad_window` around the code that reduces gradients (DeepSpeed's
  ``engine.backward``), with the loss,
- :meth:`Telemetry.step_end` after each optimizer step.

Each rank sums its numbers locally (no communication, no device sync: losses stay tensors until
the window closes). Every ``log_every`` steps all ranks all-gather one float64 vector of
``len(FIELDS)`` values and rank 0 writes one record to ``metrics.jsonl`` and W&B. That is the only
collective telemetry adds: 12 numbers a rank per window.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import resource
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from robust_plugins._logging import get_logger, warn_once
from robust_plugins.config import TelemetryConfig
from robust_plugins.telemetry import metrics
from robust_plugins.telemetry.sinks import JsonlSink, WandbSink, read_records

log = get_logger(__name__)

ENV_RUN_DIR = "ROBUST_RUN_DIR"        # set by `robust run` (watchdog/protocol.py)
ENV_INCARNATION = "ROBUST_INCARNATION"
DEFAULT_DIR = "robust_telemetry"


def telemetry_dir(cfg: TelemetryConfig) -> Path:
    """``telemetry.dir``, else ``$ROBUST_RUN_DIR/telemetry`` under ``robust run``, else ``./robust_telemetry``."""
    if cfg.dir:
        return Path(cfg.dir)
    run_dir = os.environ.get(ENV_RUN_DIR)
    return Path(run_dir) / "telemetry" if run_dir else Path(DEFAULT_DIR)


def peak_memory_bytes(device: torch.device) -> tuple[float, str]:
    """(bytes, what): CUDA max allocated on a GPU, else this process's peak resident set size."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device)), "cuda_max_allocated"
    # ru_maxrss is in KiB on Linux.
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024.0, "peak_rss"


class Telemetry:
    """Per-step metrics of one engine (see the module docstring).

    Args:
        cfg: the validated ``telemetry`` sub-block.
        run_config: what the W&B run config and the ``start`` record carry (the whole
            ``robust_plugins`` block and a description of the engine).
        n_grad_elements: trainable elements reduced each optimizer step (for the compression
            ratio's fp32 ring all-reduce reference).
        grad_element_size: bytes of one gradient element as the host reduces it.
        dp_world_size: ranks the gradients are reduced over.
        device: where this rank computes (memory metric; NCCL needs the gathered vector there).
        residual_sq_fn: returns this rank's squared error-feedback residual norm (None: 0).
        grad_norm_fn: returns the host's global gradient norm after a step (None: not logged).
        info_fn: rank 0 only, at each aggregation: extra record fields (e.g. ``codec_share``, the
            share of gradient elements each wire codec carried, and the ``auto`` codec's
            ``auto_decisions``).
        group: process group of the all-gather (None: the default group).
        wire_filter: ``fn(process group) -> bool``: the groups whose traffic inside
            :meth:`grad_window` is gradient traffic (None: every group).
    """

    def __init__(self, cfg: TelemetryConfig, *, run_config: Mapping[str, Any], n_grad_elements: int,
                 grad_element_size: int, dp_world_size: int, device: torch.device,
                 flops_per_token: float | None = None,
                 residual_sq_fn: Callable[[], float] | None = None,
                 grad_norm_fn: Callable[[], float | None] | None = None,
                 info_fn: Callable[[], Mapping[str, Any]] | None = None, group: Any = None,
                 wire_filter: Callable[[Any], bool] | None = None) -> None:
        from robust_plugins.comm.wire import WireCounter

        self.cfg = cfg
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.group = group
        self.device = device
        self.dir = telemetry_dir(cfg)
        self.incarnation = int(os.environ.get(ENV_INCARNATION, "0") or 0)
        self._wire_cls = functools.partial(WireCounter, filter_group=wire_filter) if wire_filter else WireCounter
        self._residual_sq_fn = residual_sq_fn
        self._grad_norm_fn = grad_norm_fn
        self._info_fn = info_fn
        self._ref_bytes = metrics.ring_allreduce_bytes(n_grad_elements, grad_element_size, dp_world_size)
        self.flops_per_token = cfg.flops_per_token or flops_per_token
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        self.peak_flops = metrics.peak_flops_for(device_name, cfg.peak_flops)
        if self.peak_flops is None and self.rank == 0:
            warn_once(log, "telemetry:peak_flops",
                      "robust_plugins.telemetry: no peak FLOP/s known for device %s; MFU is left empty. "
                      "Set telemetry.peak_flops (FLOP/s of one rank's device) to get it.",
                      device_name or device.type)
        self._sums = [0.0] * len(metrics.FIELDS)
        self._losses: list[torch.Tensor] = []
        self._comm_counters: list = []
        """This window's gradient-reduction counters, whose seconds are read at its end."""
        self._last_step_end: float | None = None
        self._window_start: float | None = None
        self._closed = False
        self.records: list[dict[str, Any]] = []
        """Records rank 0 wrote in this process (the file holds every incarnation's)."""
        self._jsonl: JsonlSink | None = None
        self._wandb: WandbSink | None = None
        self._history: list[dict[str, Any]] = []
        self._faults_seen = 0
        self.mem_kind = peak_memory_bytes(device)[1]
        self.hook_handles: list[Any] = []
        """Host hooks to remove on :meth:`close` (e.g. a forward pre-hook)."""
        self._heatmap_done = False
        self._sigterm: tuple[Any, Any] | None = None
        if self.rank == 0:
            self._open_sinks(run_config)

    # -- rank 0 output ---------------------------------------------------------------------------
    def _open_sinks(self, run_config: Mapping[str, Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        if (self.dir / "metrics.jsonl").is_file():
            # A restarted incarnation continues the file: ETTR needs the earlier records, and fault
            # events already copied must not be copied twice.
            self._history = read_records(self.dir)
            self._faults_seen = sum(1 for r in self._history if r.get("kind") == "fault")
        self._jsonl = JsonlSink(self.dir)
        start = {"kind": "start", "time": time.time(), "incarnation": self.incarnation,
                 "world_size": self.world, "mem_kind": self.mem_kind, "peak_flops": self.peak_flops,
                 "flops_per_token": self.flops_per_token, "config": dict(run_config)}
        self._emit(start)
        wb = self.cfg.wandb
        if wb is not None and wb.mode != "disabled":
            name = wb.name or self.dir.resolve().parent.name + "/" + self.dir.name
            if self.incarnation:
                name = f"{name}-inc{self.incarnation}"
            self._wandb = WandbSink(self.dir, project=wb.project, group=wb.group, mode=wb.mode,
                                    name=name, config=run_config)
            self._finish_on_sigterm()

    def _finish_on_sigterm(self) -> None:
        # W&B's offline writer (wandb-core) holds the run's records until the run finishes: a rank
        # stopped with SIGTERM (how torch's elastic agent, and so `robust run`, stops the healthy
        # ranks of a job it restarts) would leave an empty .wandb file. Finish the run first, then
        # let the previous handler (or the default action) run. Main thread only (Python's rule).
        if threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum, frame):
            self.close()
            if callable(previous):
                previous(signum, frame)
            else:
                signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
                os.kill(os.getpid(), signal.SIGTERM)

        signal.signal(signal.SIGTERM, on_sigterm)
        self._sigterm = (on_sigterm, previous)

    def _emit(self, record: dict[str, Any]) -> None:
        self._history.append(record)
        self.records.append(record)
        self._jsonl.write(record)

    # -- fed by the host -------------------------------------------------------------------------
    def count_tokens(self, n: int) -> None:
        """Tokens consumed by one training forward on this rank."""
        self._start_window()
        self._sums[metrics.INDEX["tokens"]] += n

    @contextlib.contextmanager
    def grad_window(self, loss: Any = None):
        """Count bytes and time of every collective issued inside (the gradient reduction)."""
        self._start_window()
        if isinstance(loss, torch.Tensor):
            self._losses.append(loss.detach())
        with self._wire_cls() as counter:
            yield
        self._sums[metrics.INDEX["grad_bytes"]] += counter.bytes_sent
        # Read at the window's end (_aggregate), not here: on CUDA the seconds are events that
        # reading would wait for, at every backward.
        self._comm_counters.append(counter)

    def _start_window(self) -> None:
        if self._window_start is None:
            self._window_start = self._last_step_end = time.perf_counter()

    def step_end(self, step: int) -> dict[str, Any] | None:
        """After optimizer step ``step`` (1-based count of completed steps). Every ``log_every``
        steps: all-gather and, on rank 0, write and return the record (None otherwise)."""
        self._start_window()
        if self.cfg.heatmap_at_start and not self._heatmap_done:
            self._heatmap_done = True
            spent = 0.0 if self._probed_by_an_earlier_incarnation() else self.probe_heatmap(step)
            # The probe is not training: keep its time out of the step and window times.
            self._last_step_end += spent
            self._window_start += spent
        now = time.perf_counter()
        dt = now - self._last_step_end
        self._last_step_end = now
        s = self._sums
        s[metrics.INDEX["steps"]] += 1
        s[metrics.INDEX["step_s"]] += dt
        s[metrics.INDEX["step_s_max"]] = max(s[metrics.INDEX["step_s_max"]], dt)
        s[metrics.INDEX["grad_ref_bytes"]] += self._ref_bytes
        if step % self.cfg.log_every:
            return None
        return self._aggregate(step, now)

    def _aggregate(self, step: int, now: float) -> dict[str, Any] | None:
        s = self._sums
        if self._losses:
            s[metrics.INDEX["loss_sum"]] = float(torch.stack([x.float() for x in self._losses]).sum())
            s[metrics.INDEX["loss_n"]] = float(len(self._losses))
        s[metrics.INDEX["grad_comm_s"]] += sum(c.seconds for c in self._comm_counters)
        self._comm_counters.clear()
        s[metrics.INDEX["mem_bytes"]] = peak_memory_bytes(self.device)[0]
        s[metrics.INDEX["residual_sq"]] = self._residual_sq_fn() if self._residual_sq_fn else 0.0
        norm = self._grad_norm_fn() if self._grad_norm_fn else None
        s[metrics.INDEX["grad_norm"]] = float("nan") if norm is None else float(norm)
        mine = torch.tensor(s, dtype=torch.float64, device=self.device)
        if self.world > 1:
            gathered = [torch.empty_like(mine) for _ in range(self.world)]
            dist.all_gather(gathered, mine, group=self.group)
        else:
            gathered = [mine]
        window_s = now - self._window_start
        self._sums = [0.0] * len(metrics.FIELDS)
        self._losses.clear()
        self._window_start = now
        if self.rank != 0:
            return None
        matrix = [g.cpu().tolist() for g in gathered]
        record = {"kind": "step", "step": int(step), "time": time.time(), "incarnation": self.incarnation,
                  **metrics.aggregate(matrix, window_s=window_s, flops_per_token=self.flops_per_token,
                                      peak_flops=self.peak_flops)}
        if self._info_fn is not None:
            record.update(self._info_fn())
        new_faults = self._new_faults()
        record["faults_total"] = self._faults_seen
        record["ettr"] = metrics.ettr([*self._history, record])["ettr"]
        self._emit(record)
        if self._wandb is not None:
            self._wandb.log(record)
            if new_faults:
                self._wandb.faults(new_faults, int(step))
        return record

    def _new_faults(self) -> list[dict[str, Any]]:
        run_dir = os.environ.get(ENV_RUN_DIR)
        if not run_dir:
            return []
        from robust_plugins.watchdog.faults import fault_view_path, read_faults

        # A multi-node job's view of every node's faults, each once (job_faults.jsonl); a single
        # node's own faults.jsonl otherwise.
        path = fault_view_path(run_dir)
        if not path.is_file():
            return []

        faults = read_faults(path)
        new = faults[self._faults_seen:]
        for i, fault in enumerate(new, start=self._faults_seen):
            self._emit({**fault, "kind": "fault", "fault_kind": fault.get("kind"), "fault_index": i,
                        "fault_time": fault.get("time"), "time": _iso_to_unix(fault.get("time"))})
        self._faults_seen += len(new)
        return new

    def _probed_by_an_earlier_incarnation(self) -> bool:
        """Whether this job already has its start-of-job heat map (a collective when restarted).

        ``heatmap_at_start`` probes once a job, not once an incarnation: a restart is recovery
        time, and the links were measured when the job began. Rank 0's records decide (it keeps
        the job's history); every rank learns the answer through one small all-reduce."""
        if self.incarnation == 0:
            return False
        had = float(any(r.get("kind") == "heatmap" for r in self._history)) if self.rank == 0 else 0.0
        if self.world == 1:
            return bool(had)
        flag = torch.tensor([had], dtype=torch.float64, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def probe_heatmap(self, step: int) -> float:
        """Probe every rank pair now (a collective: call it on every rank at the same step), write
        ``heatmap.json`` / ``heatmap.png`` and log the image. Returns the seconds it took."""
        from robust_plugins.telemetry import heatmap

        t0 = time.perf_counter()
        result = heatmap.probe(self.cfg.heatmap_bytes, group=self.group, hosts=heatmap.hosts_of_ranks(self.group))
        if self.rank == 0:
            js, png = heatmap.write(result, self.dir)
            self._heatmap(result, js, png, step)
            log.info("robust_plugins telemetry: heat map at step %d: %s (%s)", step, result["summary"], js)
        return time.perf_counter() - t0

    def _heatmap(self, result: Mapping[str, Any], json_path: Path, png_path: Path | None, step: int) -> None:
        self._emit({"kind": "heatmap", "time": time.time(), "step": step, "file": str(json_path),
                    "png": str(png_path) if png_path else None, "outliers": result.get("outliers")})
        if self._wandb is not None and png_path is not None:
            self._wandb.image("comm/heatmap", png_path, step, caption=result.get("summary", ""))

    def close(self) -> None:
        """Write the ``end`` record and finish the W&B run (idempotent; no collective)."""
        if self._closed:
            return
        self._closed = True
        for handle in self.hook_handles:
            handle.remove()
        if self._sigterm is not None and threading.current_thread() is threading.main_thread():
            ours, previous = self._sigterm
            if signal.getsignal(signal.SIGTERM) is ours:
                signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        if self.rank == 0:
            self._emit({"kind": "end", "time": time.time(), "incarnation": self.incarnation})
            if self._wandb is not None:
                self._wandb.close()
            self._jsonl.close()


def _iso_to_unix(text: Any) -> float:
    try:
        return datetime.datetime.fromisoformat(str(text)).timestamp()
    except ValueError:
        return time.time()
