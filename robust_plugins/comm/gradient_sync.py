"""Host-agnostic gradient synchronisation: the policy between a host's bucket and the wire.

A host integration (``patches/deepspeed.py`` today, megatron-core next) hands every data-parallel
gradient bucket to :class:`GradientSync`. It decides, per bucket, whether to compress (codec,
``warmup_steps``, ``min_numel``), gives each bucket a stable error-feedback key, counts what it did,
and owns the residuals that must be checkpointed. It knows nothing of DeepSpeed or Megatron.

Bucket keys are ``"<site>:<n>"`` where ``n`` counts the calls made at one reduction site since the
current optimizer step began. Hosts bucket gradients deterministically (same parameters, same
backward order, same bucket sizes every step), so the n-th bucket of a step is the same gradient
slice each step, which is what error feedback needs. A key whose size changes is reported by
:class:`~robust_plugins.comm.state.CompressionState`.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Optional

import torch

from robust_plugins._logging import get_logger
from robust_plugins.config import CompressionConfig

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


class GradientSync:
    """Routes gradient buckets through the compressed collectives under one compression config.

    Args:
        config: the validated ``compression`` sub-block.
        step_fn: returns the number of completed optimizer steps (the host's counter, which the
            host restores from its checkpoints, so warm-up survives a resume).
    """

    def __init__(self, config: CompressionConfig, step_fn: Callable[[], int]):
        from robust_plugins.comm.state import CompressionState

        self.config = config
        self._step_fn = step_fn
        self.state = CompressionState.from_config(config)
        self.stats = SyncStats()
        self._key_step: Optional[int] = None
        self._site_calls: collections.Counter = collections.Counter()

    # -- decisions -------------------------------------------------------------------------------
    def decide(self, numel: int) -> Optional[str]:
        """Return ``None`` to compress a bucket of ``numel`` elements, else why it goes uncompressed."""
        if not self.config.compresses:
            return "codec none"
        if self._step_fn() < self.config.warmup_steps:
            return "warmup"
        if numel < self.config.min_numel:
            return "below min_numel"
        return None

    def next_key(self, site: str) -> str:
        """Stable error-feedback key for the next bucket reduced at ``site`` during this step."""
        step = self._step_fn()
        if step != self._key_step:
            self._key_step = step
            self._site_calls.clear()
            self.stats.step_elements = 0
        n = self._site_calls[site]
        self._site_calls[site] += 1
        return f"{site}:{n}"

    def route(self, site: str, numel: int) -> Optional[str]:
        """Account for one bucket of ``numel`` elements reduced at ``site``.

        Returns the error-feedback key to compress it under, or ``None`` when the host's own
        collective must run (codec ``none``, warm-up, small bucket): that path stays bitwise
        identical to the host.
        """
        key = self.next_key(site)
        self.stats.step_elements += numel
        self.stats.by_site[site] += numel
        reason = self.decide(numel)
        if reason is not None:
            self.stats.passthrough_elements += numel
            self.stats.passthrough_calls += 1
            self.stats.by_reason[reason] += numel
            return None
        self.stats.compressed_elements += numel
        self.stats.compressed_calls += 1
        return key

    def all_reduce_sum(self, tensor: torch.Tensor, group, key: str) -> torch.Tensor:
        """Compressed in-place sum of ``tensor`` over ``group`` (a key from :meth:`route`)."""
        from robust_plugins.comm import compressed_all_reduce

        return compressed_all_reduce(tensor, group=group, op="sum", state=self.state, key=key)

    def reduce_sum(self, tensor: torch.Tensor, dst: int, group, key: str) -> torch.Tensor:
        """Compressed sum onto group-local rank ``dst`` (phase one only; others unchanged)."""
        from robust_plugins.comm import compressed_reduce

        return compressed_reduce(tensor, dst, group=group, op="sum", state=self.state, key=key)

    # -- checkpointing ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything needed to continue exactly: the error-feedback residuals."""
        return {"compression": self.state.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        """Restore residuals saved by :meth:`state_dict` (checks codec and block size)."""
        self.state.load_state_dict(sd["compression"])
