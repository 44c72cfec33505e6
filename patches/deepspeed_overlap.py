"""DeepSpeed ZeRO 0: compressed gradient buckets of one plan, reduced during backward.

DeepSpeed's ZeRO 0 reduces every gradient after backward (``_backward_epilogue`` ->
``allreduce_gradients`` -> ``buffered_allreduce_fallback``, 500M-element buckets), so its
reduction never overlaps backward, while PyTorch DDP starts each bucket as soon as backward has
finished it. With a compressing codec (or ``topology.hierarchical``) the plugin takes over
``buffered_allreduce_fallback`` on the engine instance and reduces the dense gradients in the
buckets of :func:`robust_plugins.comm.overlap.plan_buckets` (``compression.bucket_mb``;
parameters in reverse registration order), each bucket with DeepSpeed's scaling around the
plugin's sum, exactly as the ``allreduce_bucket`` replacement in ``patches/deepspeed_reduce.py`` does.

With ``compression.overlap`` (default: on where supported) a post-accumulate-grad hook on every
parameter counts, on the gradient-accumulation boundary micro-step only, the gradients backward
has finished; when every gradient of the next bucket in plan order is final, the training thread
routes the bucket (error-feedback key, statistics: :meth:`GradientSync.compress_key`) and submits its
reduction to a :class:`robust_plugins.comm.overlap.SyncThread`, which runs the buckets in plan
order: on CPU on one background thread over its own clones of the data-parallel groups, on CUDA
launched from the training thread onto a side stream over DeepSpeed's own groups (one host thread
drives every NCCL communicator). DeepSpeed's reduction
point (``buffered_allreduce_fallback``) then submits what is left (buckets holding a parameter
that received no gradient get DeepSpeed's zero gradient first), waits for every bucket and
returns. Without overlap the same buckets are reduced there, in the same order, with the same
keys, on the training thread: both ways give bitwise the same gradients.

With codec ``auto`` the buckets of a step that decides (the first after warm-up, each re-check)
are reduced after backward, and after such a step the reduction may go back to DeepSpeed's own
single bucket until the next re-check (:meth:`BucketedReduction._hand_back_if_off`): ``auto``
switches itself off where the link is fast.

Engines the overlap cannot serve (ZeRO 1/2, MoE, sparse gradients, optimizers that keep their own
gradient buffers such as DeepSpeed's bf16 optimizer, unmanaged gradient accumulation) keep
DeepSpeed's buckets and its reduction point: refused with ``overlap: true``, logged otherwise.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from robust_plugins._logging import get_logger, log_rank0, warn_once
from robust_plugins.comm.overlap import Completed, SyncThread, clone_groups, plan_buckets
from robust_plugins.device import default_bucket_mb
from robust_plugins.errors import UnsupportedError
from robust_plugins.patches import _guard, _ranges

log = get_logger(__name__)

_FALLBACK_SIGNATURE = ["self", "grads", "elements_per_buffer"]
#: The reduction site of the planned buckets: the same as DeepSpeed's own ZeRO 0 buckets.
SITE = "ds.engine"


def unsupported_reason(engine) -> str | None:
    """Why the planned (and overlapped) buckets cannot serve ``engine``, or None."""
    stage = engine.zero_optimization_stage()
    if stage != 0:
        return (f"ZeRO stage {stage} reduces through DeepSpeed's ZeRO optimizer (stage 2 inside backward as "
                f"its buckets fill, stage 1 after backward); the overlap covers ZeRO stage 0")
    if engine.has_moe_layers:
        return "MoE engines reduce expert gradients over expert groups"
    if any(isinstance(m, torch.nn.Embedding) and m.sparse for m in engine.module.modules()):
        return "sparse embedding gradients are reduced on DeepSpeed's sparse path"
    if hasattr(engine.optimizer, "get_grads_for_reduction"):
        return (f"the {type(engine.optimizer).__name__} optimizer reduces its own gradient buffers, filled "
                f"after backward")
    if not engine.managed_gradient_accumulation():
        return "with managed_gradient_accumulation = false gradients are reduced in engine.step()"
    if engine.pipeline_parallelism:
        return "pipeline engines reduce on their own schedule"
    return None


def bucket_mb_for(configured_mb: float | None, device_type: str) -> float:
    """The planned buckets' size in MB (pure): ``compression.bucket_mb`` when set, else the
    default of the gradients' device type (:data:`robust_plugins.device.BUCKET_MB`: 4 on CPU,
    25 on CUDA, why there); an explicit value is kept on every device."""
    return configured_mb if configured_mb is not None else default_bucket_mb(device_type)


#: The hand-back's wire trial times at most this many gradient elements (256 MB of fp32). The
#: trial holds its tensor and one run's copy: timing the whole gradient would add twice its
#: memory (a 7B model's fp32 gradient: 56 GB more). All-reduces this large are bandwidth-bound on
#: every link targeted, so fp32's and bf16's times keep the ratio the choice compares. Smaller
#: gradients (CPU tests, demos) are timed whole.
HOST_TRIAL_NUMEL = 1 << 26


def trial_tensor(grads: list, flatten) -> torch.Tensor:
    """The tensor the hand-back's wire trial times: ``flatten(grads)`` (the whole gradient, flat),
    or its first :data:`HOST_TRIAL_NUMEL` elements when it is larger."""
    if sum(g.numel() for g in grads) <= HOST_TRIAL_NUMEL:
        return flatten(grads)
    parts, n = [], 0
    for g in grads:
        take = min(g.numel(), HOST_TRIAL_NUMEL - n)
        parts.append(g.reshape(-1)[:take])
        n += take
        if n >= HOST_TRIAL_NUMEL:
            break
    return torch.cat(parts)


def attach_buckets(engine, plugin) -> "BucketedReduction | None":
    """Reduce ``engine``'s gradients in planned buckets, overlapped where supported (see the
    module docstring); None where DeepSpeed's own buckets stay. A collective with overlap."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    cfg = plugin.config.compression
    sync = plugin.sync
    if not (cfg.compresses or sync.hierarchical):
        if cfg.overlap:
            warn_once(log, "overlap-none", "robust_plugins: compression.overlap = true has nothing to overlap: "
                      "codec none without topology.hierarchical hands every bucket to DeepSpeed's own "
                      "all-reduce after backward.")
        return None
    reason = unsupported_reason(engine)
    if reason is not None:
        if cfg.overlap:
            raise UnsupportedError(f"robust_plugins.compression.overlap = true: {reason}. Set overlap to false "
                                   f"(or leave it unset) to reduce after backward.")
        log_rank0(log, logging.INFO, "robust_plugins: gradients are reduced after backward, not overlapped (%s)",
                  reason)
        return None
    _guard.check_signature("deepspeed", DeepSpeedEngine.buffered_allreduce_fallback, _FALLBACK_SIGNATURE,
                           f"deepspeed {_ranges.DEEPSPEED.spec}")
    reduction = BucketedReduction(engine, plugin, overlap=cfg.overlap is not False)
    original = engine.buffered_allreduce_fallback

    def buffered_allreduce_fallback(grads=None, elements_per_buffer=500000000):
        if grads is not None:  # an explicit gradient list is DeepSpeed's business, not the plan's
            return original(grads, elements_per_buffer)
        if reduction.host_reduces():
            # codec auto found the planned buckets not worth it (see _hand_back_if_off): DeepSpeed's
            # own reduction, one bucket in fewer, larger collectives with no hook or thread in the
            # way, its allreduce_bucket sending the wire auto chose (host_allreduce_bucket).
            reduction._emit("host", "all")
            return original(None, elements_per_buffer)
        return reduction.reduce_at_boundary()

    _guard.bind_instance(engine, "buffered_allreduce_fallback", buffered_allreduce_fallback)
    log_rank0(log, logging.INFO, "robust_plugins: %d gradient buckets of >= %g MB, %s", len(reduction.plan),
              reduction.bucket_mb, "each reduced during backward once ready" if reduction.overlap
              else "reduced after backward (compression.overlap = false)")
    return reduction


def detach_buckets(engine) -> None:
    """Undo :func:`attach_buckets` (hooks, thread, the shadowed method)."""
    plugin = engine.__dict__.get("robust_plugins")
    reduction = getattr(plugin, "buckets", None)
    if reduction is not None:
        reduction.close()
        plugin.buckets = None
    _guard.unbind_instance(engine, "buffered_allreduce_fallback")


class BucketedReduction:
    """The planned buckets of one ZeRO 0 engine and, with ``overlap``, their hooks and thread."""

    def __init__(self, engine, plugin, overlap: bool):
        import torch.distributed as dist
        from deepspeed.utils import groups

        self.engine = engine
        self.plugin = plugin
        self.sync = plugin.sync
        self.params = [p for p in engine.module.parameters() if p.requires_grad and p.numel() > 0]
        device = self.params[0].device if self.params else torch.device("cpu")
        self.bucket_mb = bucket_mb_for(plugin.config.compression.bucket_mb, device.type)
        """The planned buckets' size (MB): ``compression.bucket_mb``, or the device's default if unset."""
        numel = max(1, int(self.bucket_mb * 2**20 / 4))
        self.plan: list[list[int]] = plan_buckets([(p.numel(), p.dtype) for p in self.params], numel)
        """Parameter indices (into :attr:`params`) of each bucket, in reduction order."""
        # DeepSpeed's own ZeRO 0 group and averaging world (_reduce_non_expert_gradients).
        group = groups._get_sequence_data_parallel_group()
        self.group = group if group is not None else dist.group.WORLD
        self.world = dist.get_world_size(self.group) / float(engine.sequence_parallel_size)
        self.overlap = overlap
        self.observers: list = []
        """Callables ``fn(event, bucket_name)``: ``dispatch`` (training thread: inside backward from a
        hook, or at the reduction point), ``flush`` (training thread, the reduction point starts),
        ``start`` / ``done`` (sync thread), ``wait`` (training thread). For tests and tracing."""
        self.thread: SyncThread | None = None
        self.clone = None
        self._hooks: list = []
        self._bucket_of = {i: b for b, idx in enumerate(self.plan) for i in idx}
        self._gen: Any = None
        self._missing: list[int] = []
        self._next = 0
        self._handles: list = []
        self._keys: list = []
        self._host_until: float | None = None
        """``codec: auto``: the engine step until which DeepSpeed reduces on its own (see
        :meth:`host_reduces`); None while the planned buckets are in use."""
        self.host_wire = "deepspeed"
        """While :meth:`host_reduces`: ``deepspeed`` (its own all-reduce) or ``bf16`` (see
        :meth:`_choose_host_wire`)."""
        self.host_choices: list = []
        """Every hand-back: step, why, wire and the wire's reason (for tests and telemetry)."""
        self.host_trial_s: dict = {}
        """The last wire trial's medians (seconds), by wire."""
        if overlap:
            if self.sync.hierarchical:
                # Node and rail groups now, on every rank (a collective), not at the first bucket
                # on the sync thread while the training thread runs on.
                self.sync._hierarchy(self.group)
            self.clone = clone_groups([self.group])[id(self.group)]
            self.thread = SyncThread("robust-ds-grad-sync", "DeepSpeed gradient bucket", self._emit,
                                     device=device)
            for i, p in enumerate(self.params):
                self._hooks.append(p.register_post_accumulate_grad_hook(self._hook(i)))

    # -- events ----------------------------------------------------------------------------------
    def _emit(self, event: str, name: str) -> None:
        for fn in list(self.observers):
            fn(event, name)

    # -- one backward ----------------------------------------------------------------------------
    def _generation(self):
        e = self.engine
        return (e.global_steps, e.micro_steps)

    def _begin(self) -> None:
        """Start a new boundary backward: forget the last one (waiting for anything it left)."""
        leftover, self._handles = self._handles, []
        for h in leftover:  # an earlier backward that raised before its reduction point
            try:
                h.wait()
            except Exception as exc:  # noqa: BLE001 - that step failed already; say so and go on
                log.warning("robust_plugins: a gradient bucket of an interrupted backward failed: %r", exc)
        self._gen = self._generation()
        self._missing = [len(idx) for idx in self.plan]
        self._next = 0
        self._keys = []

    def _boundary_now(self) -> bool:
        e = self.engine
        return e.is_gradient_accumulation_boundary() and e.enable_backward_allreduce and not e.inside_no_sync_ctxt

    def _hook(self, index: int):
        bucket = self._bucket_of[index]

        def on_grad_final(_param) -> None:
            if not self._boundary_now() or self.host_reduces() or self.sync.auto_deciding():
                # Gradients still accumulate locally; or DeepSpeed reduces this step itself; or
                # auto times its trial routes this step: after backward (reduce_at_boundary),
                # where the trials do not compete with backward for the cores (on the simulator's
                # 10 Gbit/s link, trials during backward once chose bf16 for some buckets and none
                # for others, where trials after backward chose none for all).
                return
            if self._gen != self._generation():
                self._begin()
            self._missing[bucket] -= 1
            # Plan order, never readiness order: every rank submits the same sequence.
            while self._next < len(self.plan) and self._missing[self._next] <= 0:
                self._dispatch(self._next)
                self._next += 1

        return on_grad_final

    def _dispatch(self, b: int) -> None:
        grads = []
        for i in self.plan[b]:
            p = self.params[i]
            if p.grad is None:
                # DeepSpeed's _get_gradients_for_reduction: every rank reduces the same sizes.
                p.grad = torch.zeros(p.size(), dtype=p.dtype, device=p.device)
            if p.grad.is_sparse:
                raise UnsupportedError(f"robust_plugins: parameter {i} has a sparse gradient; the planned "
                                       f"buckets reduce dense gradients only (unset sparse_gradients).")
            grads.append(p.grad.data)
        key = self.sync.compress_key(SITE, sum(g.numel() for g in grads))
        self._keys.append(key)
        name = f"b{b}"
        self._emit("dispatch", name)
        if self.thread is None:
            self._reduce(grads, key, self.group)
            self._handles.append(Completed())
            return
        # On a GPU the thread's stream waits for the kernels that produced these gradients and
        # the waiting stream for the thread's (events, SyncThread): no host synchronize here.
        self._handles.append(self.thread.submit(name, lambda: self._reduce(grads, key, self.clone), grads))

    def _reduce(self, grads: list, key, group) -> None:
        """One bucket: DeepSpeed's ``allreduce_bucket`` (uncompressed: warm-up, ``min_numel``) or its
        scaling around the plugin's sum, then the copy back (``allreduce_and_copy``)."""
        from robust_plugins.patches.deepspeed_reduce import _scaled_sum, _scaling

        e = self.engine
        if key is None:
            flat = type(e).allreduce_bucket(e, grads, group, self.world)
        else:
            flat = e.flatten(grads)
            pre, post = _scaling(e.gradient_average, e.postscale_gradients(), e.gradient_predivide_factor(),
                                 self.world, self.world)
            _scaled_sum(self.plugin, flat, group, key, pre, post)
        for buf, synced in zip(grads, e.unflatten(flat, grads)):
            buf.copy_(synced)

    def reduce_at_boundary(self) -> None:
        """DeepSpeed's reduction point (``buffered_allreduce_fallback`` of the module's gradients):
        submit the buckets backward did not finish, in plan order, and wait for every bucket."""
        if self.thread is None or self._gen != self._generation():
            self._begin()
        self._emit("flush", f"b{self._next}")
        while self._next < len(self.plan):
            self._dispatch(self._next)
            self._next += 1
        handles, self._handles = self._handles, []
        keys, self._keys = self._keys, []
        self._gen = None
        for h in handles:
            h.wait()
        self._hand_back_if_off(keys)

    # -- codec auto: switching itself off ----------------------------------------------------------
    def _hand_back_if_off(self, keys: list) -> None:
        """After a step of planned buckets, hand the reduction back to DeepSpeed's one bucket (its
        wire from :meth:`_choose_host_wire`) until ``auto`` is due to measure again
        (``auto_recheck_steps``; never with 0) where :meth:`GradientSync.hand_back_reason
        <robust_plugins.comm.gradient_sync.GradientSync.hand_back_reason>` names a reason: planned
        buckets cost more collectives (and, with overlap, a thread competing with backward) for the
        same sums. Every rank agrees: ``auto``'s decisions are agreed over the group."""
        why = self.sync.hand_back_reason(keys)
        if why is None:
            return
        due = self.sync.auto.next_recheck_step()
        self._host_until = math.inf if due is None else due
        self.host_wire, wire_why = self._choose_host_wire()
        self.host_choices.append({"step": self.engine.global_steps, "why": why, "wire": self.host_wire,
                                  "wire_reason": wire_why, "until": due})
        log_rank0(log, logging.INFO,
                  "robust_plugins: codec auto %s; DeepSpeed reduces the gradients itself in one bucket after "
                  "backward, %s (%s), %s", why,
                  "as a bf16 all-reduce" if self.host_wire == "bf16" else "with its own all-reduce", wire_why,
                  "from now on (auto_recheck_steps = 0)" if due is None
                  else f"until step {due}, when auto measures the buckets again")

    def _choose_host_wire(self) -> tuple[str, str]:
        """What the handed-back reduction sends: ``"deepspeed"`` (DeepSpeed's own all-reduce, its
        ``communication_data_type``) or ``"bf16"`` (DeepSpeed's bf16 scheme), as ``auto`` chooses
        (:meth:`AutoCodec.host_wire <robust_plugins.comm.autocodec.AutoCodec.host_wire>`, a
        collective on the data-parallel group) on this step's gradient (:func:`trial_tensor`), where
        DeepSpeed sends fp32 gradients."""
        e = self.engine
        grads = [self.params[i].grad.data for idx in self.plan for i in idx]
        if e.communication_data_type != torch.float32 or any(g.dtype != torch.float32 for g in grads):
            return "deepspeed", f"DeepSpeed's communication_data_type is {e.communication_data_type}"
        wire, reason, self.host_trial_s = self.sync.auto.host_wire(lambda: trial_tensor(grads, e.flatten), self.group)
        return ("bf16" if wire == "bf16" else "deepspeed"), reason

    def host_allreduce_bucket(self, original, bucket, dp_group, dp_world_size):
        """DeepSpeed's ``allreduce_bucket`` while :meth:`host_reduces`: its own (``host_wire``
        ``deepspeed``), or its bf16 scheme (``bf16``: cast, one bf16 all-reduce, DeepSpeed's
        scaling, cast back; what ``communication_data_type: bf16`` does, without touching its config)."""
        from robust_plugins.comm.collectives import bf16_all_reduce
        from robust_plugins.patches.deepspeed_reduce import _scaled, _scaling

        numel = sum(t.numel() for t in bucket)
        self.sync.count_passthrough(SITE, numel, f"auto: DeepSpeed's one bucket, {self.host_wire}")
        if self.host_wire != "bf16":
            return original(bucket, dp_group, dp_world_size)
        import torch.distributed as dist

        e = self.engine
        tensor = e.flatten(bucket)
        world = dp_world_size if dp_world_size is not None else dist.get_world_size(group=dp_group)
        pre, post = _scaling(e.gradient_average, e.postscale_gradients(), e.gradient_predivide_factor(), world,
                             world)
        return _scaled(tensor, pre, post, lambda t: bf16_all_reduce(t, group=dp_group, op="sum"))

    def host_reduces(self) -> bool:
        """True while ``auto`` has handed this step's reduction back to DeepSpeed (see
        :meth:`_hand_back_if_off`). At the step ``auto`` is due to measure again the planned
        buckets return for that step, and ``auto``'s new decisions say what follows."""
        if self._host_until is None:
            return False
        if self.engine.global_steps < self._host_until:
            return True
        self._host_until = None
        self.host_wire = "deepspeed"
        log_rank0(log, logging.INFO, "robust_plugins: step %d: codec auto measures the planned buckets again",
                  self.engine.global_steps)
        return False

    def close(self) -> None:
        """Remove the hooks and stop the thread (after the work already submitted)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.thread is not None:
            self.thread.close()
            self.thread = None
