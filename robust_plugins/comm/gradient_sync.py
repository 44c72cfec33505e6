"""Host-agnostic gradient synchronisation: the policy between a host's bucket and the wire.

A host integration (``patches/deepspeed.py``, ``patches/megatron.py``) hands every data-parallel
gradient bucket to :class:`GradientSync`. It decides, per bucket, whether to compress (codec,
``warmup_steps``, ``min_numel``), gives each bucket a stable error-feedback key, counts what it did,
and owns the residuals that must be checkpointed. It knows nothing of DeepSpeed or Megatron.

Bucket keys are ``"<site>:<n>"`` where ``n`` counts the calls made at one reduction site since the
current optimizer step began. Hosts bucket gradients deterministically (same parameters, same
backward order, same bucket sizes every step), so the n-th bucket of a step is the same gradient
slice each step, which is what error feedback needs. A key whose size changes is reported by
:class:`~robust_plugins.comm.state.CompressionState`.

Every bucket takes one path: :meth:`GradientSync._route` names its route (``"<layout> <codec>"``),
then :func:`run_route` reduces it. With ``topology.hierarchical`` the layout is ``hier``
(:func:`~robust_plugins.topology.hierarchical_all_reduce` /
:func:`~robust_plugins.topology.hierarchical_reduce_scatter`; the groups are discovered and built
at the first bucket, a collective over the whole job, each data-parallel group's hierarchy planned
on its own ranks). With ``codec: auto`` the route is the decision of
:class:`~robust_plugins.comm.autocodec.AutoCodec` per group and bucket size (with
``topology.hierarchical`` "the hierarchy may be used"), among them ``flat bf16_allreduce``, one bf16
all-reduce of the whole bucket, with error feedback of the cast's rounding only with
``auto_bf16_error_feedback``; each codec keeps its own residuals, dropped when a bucket's route
changes. A host with several data-parallel groups (megatron-core's dense and expert groups) gets
one hierarchy and one set of ``auto`` decisions per group: :meth:`GradientSync.prepare` builds the
groups' hierarchies up front, in the same order on every rank; a group of one rank sends nothing. Reduce-scatters (:meth:`GradientSync.reduce_scatter_sum`: megatron-core's distributed
optimizer, DeepSpeed ZeRO-3) take the same settings with the reduce-scatter's time model.
"""

from __future__ import annotations

import collections
import logging
import dataclasses
from typing import Callable, Optional

import torch

from robust_plugins._logging import get_logger, log_rank0, warn_once
from robust_plugins.comm.auto_model import hand_back_reason
from robust_plugins.comm.autocodec import AutoCodec
from robust_plugins.comm.state import CompressionState
from robust_plugins.config import AUTO_CODEC, BF16_ALLREDUCE, CompressionConfig, TopologyConfig
from robust_plugins.errors import CheckpointError, UnsupportedError

log = get_logger(__name__)


@dataclasses.dataclass
class SyncStats:
    """What went through the plugin; cumulative, and for the step in progress."""

    compressed_elements: int = 0
    passthrough_elements: int = 0
    compressed_calls: int = 0
    passthrough_calls: int = 0
    by_reason: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """Uncompressed elements by reason (``codec none``, ``warmup``, ``below min_numel``)."""
    by_site: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """Elements by reduction site (which host code path handed them over)."""
    step_elements: int = 0
    """Elements (compressed or not) handed to the plugin since the current step began."""
    hierarchical_elements: int = 0
    """Elements reduced by the hierarchical all-reduce (``topology.hierarchical``)."""
    by_codec: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """Elements by the wire codec the plugin's own collective used (``none`` included)."""
    by_route: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """``codec: auto`` with ``topology.hierarchical`` only: elements by route (``"flat none"``,
    ``"hier int8"``, ...), the layout and codec ``auto`` chose."""
    auto_decisions: list = dataclasses.field(default_factory=list)
    """``codec: auto`` only: the decisions in force, one dict per (group, bucket size), with the
    predicted time of every candidate and the reason (see ``robust_plugins.comm.autocodec``)."""


class GradientSync:
    """Routes gradient buckets through the compressed collectives under one compression config.

    Args:
        config: the validated ``compression`` sub-block.
        step_fn: returns the number of completed optimizer steps (the host's counter, which the
            host restores from its checkpoints, so warm-up survives a resume).
        topology: the validated ``topology`` sub-block, or ``None`` (flat).
    """

    def __init__(self, config: CompressionConfig, step_fn: Callable[[], int],
                 topology: Optional[TopologyConfig] = None):
        self.config = config
        self.topology = topology
        self.hierarchical = topology is not None and topology.hierarchical
        self._step_fn = step_fn
        self.auto = None
        if config.codec == AUTO_CODEC:
            bf16_ef = config.auto_bf16_error_feedback and config.error_feedback
            self.auto = AutoCodec(
                candidates=config.auto_candidates, block_size=config.block_size, min_gain=config.auto_min_gain,
                max_error=config.auto_max_error, link_gbit=config.auto_link_gbit,
                recheck_steps=config.auto_recheck_steps, step_fn=step_fn, bf16_error_feedback=bf16_ef,
            )
            # bf16_allreduce keeps residuals only with auto_bf16_error_feedback; without, it is
            # DeepSpeed's plain bf16 all-reduce and has no state to keep.
            codecs = [c for c in self.auto.candidates if c != "none" and (c != BF16_ALLREDUCE or bf16_ef)]
        else:
            codecs = [config.codec]
        # bf16_allreduce keeps only a sender residual of its cast; a bf16 CompressionState stores it
        # (the state's codec names the rounding, bf16, and is checked when a checkpoint loads).
        self.states = {
            c: CompressionState(codec="bf16" if c == BF16_ALLREDUCE else c, block_size=config.block_size,
                                error_feedback=config.error_feedback,
                                min_numel=config.min_numel if self.auto is None else 0)
            for c in codecs
        }
        """One error-feedback state per codec (or ``bf16_allreduce`` route) this sync may send with."""
        self.stats = SyncStats()
        self._key_step: Optional[int] = None
        self._site_calls: collections.Counter = collections.Counter()
        self._hierarchies: dict = {}
        """:func:`group_key` of a process group -> its :class:`~robust_plugins.topology.builder.TopologyGroups`."""
        self._last_codec: dict = {}
        self._route_decisions: dict = {}

    @property
    def state(self):
        """The :class:`~robust_plugins.comm.state.CompressionState` of a fixed codec.

        ``codec: auto`` has one state per candidate (:attr:`states`) and chooses per bucket, so a
        host that reduces buckets itself must go through :meth:`all_reduce_sum` instead.
        """
        if self.auto is not None:
            raise UnsupportedError(
                "compression.codec = 'auto' chooses the codec per bucket inside GradientSync; this host "
                "integration reduces buckets with one fixed state. Use a fixed codec (none, bf16, int8, int4) here."
            )
        return self.states[self.config.codec]

    # -- decisions -------------------------------------------------------------------------------
    def passthrough_reason(self, numel: int, group_size: Optional[int] = None) -> Optional[str]:
        """Why a bucket of ``numel`` elements reduced over ``group_size`` ranks goes uncompressed
        (the host's own collective, which sends nothing on one rank), or ``None``: compress it."""
        if group_size == 1:
            return "one rank"
        if not self.config.compresses and not self.hierarchical:
            return "codec none"
        if self._step_fn() < self.config.warmup_steps:
            return "warmup"
        if numel < self.config.min_numel:
            return "below min_numel"
        return None

    def _new_step_check(self) -> None:
        """At the first bucket of an optimizer step: restart the per-step key counts and totals."""
        step = self._step_fn()
        if step != self._key_step:
            self._key_step = step
            self._site_calls.clear()
            self.stats.step_elements = 0

    def next_key(self, site: str) -> str:
        """Stable error-feedback key for the next bucket reduced at ``site`` during this step."""
        self._new_step_check()
        n = self._site_calls[site]
        self._site_calls[site] += 1
        return f"{site}:{n}"

    def compress_key(self, site: str, numel: int, group_size: Optional[int] = None) -> Optional[str]:
        """Account for one bucket of ``numel`` elements reduced at ``site`` over ``group_size`` ranks
        (None: not known to the host integration, taken as several).

        Returns the error-feedback key to compress it under, or ``None`` when the host's own
        collective must run (codec ``none``, warm-up, small bucket, a group of one rank): that
        path stays bitwise identical to the host.
        """
        key = self.next_key(site)
        reason = self.passthrough_reason(numel, group_size)
        if reason is not None:
            self.count_passthrough(site, numel, reason)
            return None
        self.stats.step_elements += numel
        self.stats.by_site[site] += numel
        self.stats.compressed_elements += numel
        self.stats.compressed_calls += 1
        return key

    def count_passthrough(self, site: str, numel: int, reason: str) -> None:
        """Account for a bucket the host reduced itself, for ``reason``, without :meth:`compress_key` (a host
        integration that handed its whole reduction back, see ``patches/deepspeed_overlap.py``)."""
        self._new_step_check()
        self.stats.step_elements += numel
        self.stats.by_site[site] += numel
        self.stats.passthrough_elements += numel
        self.stats.passthrough_calls += 1
        self.stats.by_reason[reason] += numel

    def auto_deciding(self) -> bool:
        """``auto`` only: whether this step's buckets make new decisions (trial runs), i.e. the first
        step after warm-up and every re-check step. A host that overlaps buckets with backward
        reduces such a step's buckets after backward instead, so that the trials time the link,
        not the link plus a backward competing for the same cores."""
        if self.auto is None:
            return False
        step = self._step_fn()
        return step >= self.config.warmup_steps and self.auto.due(step)

    def decision_of(self, key):
        """``auto`` only: the :class:`~robust_plugins.comm.auto_model.Decision` the last bucket under
        ``key`` was reduced by (its route, trial times and predictions); None before its first
        reduction, without ``auto``, or on the codec-only path (no hierarchy plan)."""
        return self._route_decisions.get(key) if self.auto is not None else None

    def route_of(self, key) -> Optional[str]:
        """``auto`` only: the route (``"flat none"``, ``"hier int8"``, ...) the last bucket under
        ``key`` was reduced with; None before its first reduction or without ``auto``."""
        if self.auto is None:
            return None
        last = self._last_codec.get(key)
        if last is None:
            return None
        return last if " " in last else f"flat {last}"  # the codec-only path is flat (no hierarchy plan)

    def hand_back_reason(self, keys: list) -> Optional[str]:
        """``auto`` only: why a host that can reduce a whole step in its own single bucket should,
        after a step whose buckets went under ``keys`` (:func:`~robust_plugins.comm.auto_model.hand_back_reason`),
        or None: keep the buckets (also without ``auto`` and after a warm-up step, a ``None`` key)."""
        if self.auto is None or not keys or any(k is None for k in keys):
            return None
        return hand_back_reason([self.route_of(k) for k in keys], [self.decision_of(k) for k in keys],
                                self.auto.min_gain)

    def _hierarchy(self, group):
        """The node and rail groups planned inside ``group`` (``None``: the whole job), built at the
        first call for a group with those ranks and kept (a sync thread's clone of ``group`` finds
        the host group's). Building is a collective over the whole job: every rank must ask for
        its groups in the same order, so a host with several data-parallel groups (megatron's
        dense and expert groups) builds them all up front with :meth:`prepare`."""
        key = group_key(group)
        groups = self._hierarchies.get(key)
        if groups is None:
            import torch.distributed as dist

            from robust_plugins.topology import build_dp_groups, build_groups, discover
            from robust_plugins.topology.sources import K8sEnv

            t = self.topology
            k8s = K8sEnv(t.k8s_node_env, t.k8s_switch_envs, t.k8s_domain_env) if t.k8s_node_env else None
            topo = discover(t.file, k8s=k8s)
            if group is not None and dist.get_world_size(group) != dist.get_world_size():
                # Tensor/pipeline/expert parallelism: the data-parallel group is a subset of the
                # job. Every rank learns every rank's group (one all-gather over the job) and plans
                # each group's hierarchy on its own ranks.
                everyone: list = [None] * dist.get_world_size()
                dist.all_gather_object(everyone, dist.get_process_group_ranks(group))
                dp_groups = sorted({tuple(sorted(g)) for g in everyone})
                groups = build_dp_groups(topo.records, dp_groups, group)
            else:
                groups = build_groups(topo.records)
            self._hierarchies[key] = groups
            log_rank0(log, logging.INFO,
                      "hierarchical gradient sync over %s (group of %d ranks): node of %d ranks, rail of %d ranks%s",
                      topo.source, len(key), len(groups.intra_ranks), len(groups.rail_ranks),
                      f" (FLAT fallback: {groups.fallback_reason})" if groups.plan is None else "")
        return groups

    def prepare(self, groups: list) -> None:
        """``topology.hierarchical``: build the hierarchy of each process group in ``groups`` now, in
        order (a collective over the whole job: every rank passes its own groups of the same kinds
        in the same order, e.g. its dense then its expert data-parallel group). A group of one rank
        has none (it sends nothing: :meth:`passthrough_reason`); a group seen before is kept."""
        import torch.distributed as dist

        if not self.hierarchical:
            return
        for group in groups:
            if dist.get_world_size(group) > 1:
                self._hierarchy(group)

    def _groups_for(self, group, collective: str):
        """``topology.hierarchical``: the node and rail groups for a bucket reduced on ``group``
        (planned inside ``group``'s own ranks); else None. The flat fallback (and every
        reduce-scatter) reduces on the group this call was given (a sync thread's clone on gloo,
        with the same ranks in the same order), never on the one the hierarchy was planned with:
        that is the host's, which the training thread drives (comm/overlap.py)."""
        if not self.hierarchical:
            return None
        groups = self._hierarchy(group)
        if groups.group is not group and (collective == "reduce_scatter" or groups.plan is None):
            groups = dataclasses.replace(groups, group=group)
        return groups

    def _route(self, tensor: torch.Tensor, group, groups, key: str, output: Optional[torch.Tensor] = None) -> str:
        """The route (``"<layout> <codec>"``) of this bucket, an all-reduce of ``tensor`` or, with
        ``output``, its reduce-scatter. ``hier`` is the hierarchical collective on ``groups`` (or its
        flat fallback, where the hierarchy has no plan). A fixed codec takes the layout of
        ``topology.hierarchical``; ``auto`` (a collective) decides once per bucket size and group,
        in :meth:`AutoCodec.decide <robust_plugins.comm.autocodec.AutoCodec.decide>`: the route on
        a group of several ranks (the hierarchy's routes where it has a plan), else the codec of the
        two-phase collectives. A bucket whose route or codec changed restarts its residuals."""
        import torch.distributed as dist

        n = tensor.numel()
        layout = "flat" if groups is None else "hier"
        if self.auto is None:
            self.stats.by_codec[self.config.codec] += n
            return f"{layout} {self.config.codec}"
        planned = groups is not None and groups.plan is not None
        before = len(self.auto.history)
        if dist.is_initialized() and dist.get_world_size(group) > 1 and (planned or layout == "flat" or output is not None):
            hier = groups if planned else None
            d = self.auto.decide(tensor, group, intra=hier.intra if hier else None, rail=hier.rail if hier else None,
                                 per_node=len(hier.intra_ranks) if hier else 1,
                                 run=_trial_run(group, hier, output, BF16_ALLREDUCE in self.states),
                                 collective="all_reduce" if output is None else "reduce_scatter")
            route, ef_key, kept = d.route, key, d.route
            self._route_decisions[key] = d
            self.stats.by_route[route] += n
        else:  # one rank, or a hierarchy without a plan (its flat fallback): the codec only
            d = self.auto.decide(tensor, group)
            route, ef_key, kept = f"{layout} {d.codec}", key, d.codec
        if len(self.auto.history) != before:
            self.stats.auto_decisions = self.auto.decisions()
        last = self._last_codec.get(ef_key)
        if last is not None and last != kept:
            old_codec = last.split()[-1]
            if old_codec in self.states:
                # Another quantizer or another slice (flat keeps the whole bucket's residual, the
                # hierarchy this rank's shard): both sides restart from zero.
                self.states[old_codec].forget(ef_key)
                self.states[old_codec].forget(("hierarchical", ef_key))
            log_rank0(log, logging.INFO, "auto: bucket %s switched %s -> %s; its residuals restart", ef_key, last, kept)
        self._last_codec[ef_key] = kept
        self.stats.by_codec[d.codec] += n
        return route

    def all_reduce_sum(self, tensor: torch.Tensor, group, key: str) -> torch.Tensor:
        """In-place sum of ``tensor`` over ``group`` (a key from :meth:`compress_key`) on this
        bucket's route (:meth:`_route`): compressed, and hierarchical with ``topology.hierarchical``."""
        groups = self._groups_for(group, "all_reduce")
        route = self._route(tensor, group, groups, key)
        return self._reduce(route, tensor, group, groups, key)

    def reduce_scatter_sum(self, output: torch.Tensor, input: torch.Tensor, group, key: str) -> torch.Tensor:
        """``output`` = the sum over ``group`` of ``input``'s shard ``rank`` (as
        ``reduce_scatter_tensor`` cuts it), for a key from :meth:`compress_key`, on this bucket's
        route (:meth:`_route`, with the reduce-scatter's time model for ``auto``; ``flat none`` is
        the host's plain ``reduce_scatter_tensor``): compressed, and hierarchical with
        ``topology.hierarchical`` (:func:`~robust_plugins.topology.hierarchical_reduce_scatter`).
        ``output`` may be a view into ``input``."""
        groups = self._groups_for(group, "reduce_scatter")
        route = self._route(input, group, groups, key, output)
        return self._reduce(route, input, group, groups, key, output)

    def reduce_sum(self, tensor: torch.Tensor, dst: int, group, key: str) -> torch.Tensor:
        """Compressed sum onto group-local rank ``dst`` (phase one only; the others' ``tensor`` is
        left as it is): DeepSpeed ZeRO 1/2's reduce to one rank. Always flat (with
        ``topology.hierarchical`` too, said once); ``auto`` picks the codec alone."""
        from robust_plugins.comm import compressed_reduce

        if self.hierarchical:
            warn_once(log, "hierarchical-reduce", "topology.hierarchical covers all-reduces and reduce-scatters: "
                      "a reduce to one rank (%s) stays a flat compressed reduce.", key)
        if self.auto is None:
            codec = self.config.codec
        else:
            before = len(self.auto.history)
            codec = self.auto.decide(tensor, group).codec
            if len(self.auto.history) != before:
                self.stats.auto_decisions = self.auto.decisions()
            last = self._last_codec.get(key)
            if last is not None and last != codec and last in self.states:
                self.states[last].forget(key)  # another quantizer's residual: both sides restart
                log_rank0(log, logging.INFO, "auto: bucket %s switched %s -> %s; its residuals restart", key, last, codec)
            self._last_codec[key] = codec
        self.stats.by_codec[codec] += tensor.numel()
        state = self.states.get(codec)
        return compressed_reduce(tensor, dst, group=group, codec=None if state else codec, op="sum",
                                 state=state, key=key)

    def _reduce(self, route: str, tensor: torch.Tensor, group, groups, key: str,
                output: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Run ``route`` on this bucket with the error-feedback state of its codec under ``key``."""
        if route.startswith("hier "):
            self.stats.hierarchical_elements += tensor.numel()
        state = self.states.get(route.split()[1])
        return run_route(route, tensor, group, groups, output=output, state=state, key=key)

    # -- checkpointing ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything needed to continue exactly: the error-feedback residuals (per codec for auto)."""
        if self.auto is None:
            return {"compression": self.state.state_dict()}
        return {"compression_auto": {c: st.state_dict() for c, st in self.states.items()}}

    def load_state_dict(self, sd: dict) -> None:
        """Restore residuals saved by :meth:`state_dict` (checks codec and block size)."""
        want = "compression" if self.auto is None else "compression_auto"
        if want not in sd:
            raise CheckpointError(
                f"the checkpoint's compression state was written with "
                f"{'a fixed codec' if 'compression' in sd else 'codec auto'} but this job runs codec "
                f"{self.config.codec!r}; run with the checkpoint's codec or drop the plugin state file."
            )
        if self.auto is None:
            self.state.load_state_dict(sd["compression"])
            return
        for codec, st in sd["compression_auto"].items():
            if codec in self.states:
                self.states[codec].load_state_dict(st)
            else:  # e.g. bf16_allreduce residuals saved with auto_bf16_error_feedback, which is now off
                log_rank0(log, logging.WARNING, "auto codec: the checkpoint's %s residuals are not used: this "
                          "job does not feed back %s (its next bucket starts from a zero residual).", codec, codec)



def group_key(group) -> tuple:
    """A process group's global ranks (every rank of the job for ``None``); ``("none",)`` without
    torch.distributed. Clones of a group (same ranks, same order) share the key."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return ("none",)
    if group is None:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def run_route(route: str, tensor: torch.Tensor, group, groups, *, output: Optional[torch.Tensor] = None,
              state=None, key=None, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Sum ``tensor`` over ``group`` on ``route`` (``"<layout> <codec>"``): in place, or with
    ``output`` as a reduce-scatter into it. ``hier`` runs the hierarchical collective on ``groups``
    (which falls back to the flat one, with a warning, where the hierarchy has no plan). ``state``
    and ``key`` give the codec's error feedback (none without a state); the ``bf16_allreduce``
    route feeds back into ``residual``, or into the state's sender residual under ``key``."""
    from robust_plugins.comm import compressed_all_reduce, compressed_reduce_scatter
    from robust_plugins.comm.collectives import bf16_all_reduce
    from robust_plugins.topology import hierarchical_all_reduce, hierarchical_reduce_scatter

    layout, codec = route.split()
    wire = None if state is not None else codec
    if output is not None:
        if layout == "hier":
            return hierarchical_reduce_scatter(output, tensor, groups, codec=wire, op="sum", state=state, key=key)
        return compressed_reduce_scatter(output, tensor, group=group, codec=wire, op="sum", state=state, key=key)
    if codec == BF16_ALLREDUCE:
        if residual is None and state is not None and state.error_feedback:
            residual = state.sender_residual(key, tensor.numel(), tensor.device)
        return bf16_all_reduce(tensor, group=group, op="sum", residual=residual)
    if layout == "hier":
        return hierarchical_all_reduce(tensor, groups, codec=wire, op="sum", state=state, key=key)
    return compressed_all_reduce(tensor, group=group, codec=wire, op="sum", state=state, key=key)


def _trial_run(group, groups, output: Optional[torch.Tensor], bf16_error_feedback: bool):
    """``run(route, copy)`` for ``auto``'s trial runs: :func:`run_route` on ``group`` (and the
    hierarchy ``groups``), without error-feedback state; a reduce-scatter into a scratch copy of
    ``output`` when given."""
    scratch: dict = {}  # lives for this bucket's trials only

    def run(route: str, t: torch.Tensor) -> None:
        out = None if output is None else torch.empty_like(output)
        res = None
        if route.endswith(BF16_ALLREDUCE) and bf16_error_feedback:
            # Its error feedback is most of its compute (3 passes of 4 over the bucket), so the
            # trial pays for it, on a scratch residual that is thrown away. The scratch is kept
            # for a second trial run: a step reuses its residual, and allocating (first-touch
            # pages of a bucket-sized buffer) is a cost the first run alone pays.
            res = scratch.get(t.numel())
            if res is None:
                res = scratch[t.numel()] = torch.zeros(t.numel(), dtype=torch.float32, device=t.device)
        run_route(route, t, group, groups, output=out, residual=res)

    return run
