"""megatron-core side of :class:`robust_plugins.megatron.MegatronCheckpointer`.

The checkpointer (core) keeps the protocol: the config, the atomic directory and its manifest, the
restore order, the data-parallel reshard plan, SIGTERM. Every call into megatron-core it needs is
here: the parallel layout (``parallel_state``), the sharded state dict of the model chunks and the
optimizer, ``dist_checkpointing.save`` / ``load`` and the tensor-parallel RNG tracker.
megatron-core is imported when a function runs; the caller checks its version first
(:func:`robust_plugins.patches.megatron.check_megatron_version`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from robust_plugins.patches import megatron_optim


def layout() -> dict[str, int]:
    """This job's tensor-, pipeline- and data-parallel sizes: ``{"tp", "pp", "dp"}``."""
    from megatron.core import parallel_state as ps

    return {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size()}


def virtual_pipeline_size() -> int | None:
    """megatron's ``virtual_pipeline_model_parallel_size`` (None without virtual stages)."""
    from megatron.core import parallel_state as ps

    return ps.get_virtual_pipeline_model_parallel_world_size()


def extra_parallel_sizes() -> dict[str, int]:
    """The context- and expert-parallel sizes: ``{"context", "expert"}``."""
    from megatron.core import parallel_state as ps

    return {"context": ps.get_context_parallel_world_size(), "expert": ps.get_expert_model_parallel_world_size()}


def saved_rank_of_this_position(tp: int, saved_dp: int) -> int:
    """The rank, in a layout of tensor size ``tp`` and data-parallel size ``saved_dp``, at this
    rank's tensor and pipeline position and data-parallel rank 0.

    megatron's default order (tp-cp-ep-dp-pp): rank = tp_rank + tp * (dp_rank + dp * pp_rank)."""
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank() + tp * saved_dp * ps.get_pipeline_model_parallel_rank()


def tracker_rng_states() -> dict:
    """The model-parallel RNG streams of megatron's tracker (``get_cuda_rng_tracker``)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return get_cuda_rng_tracker().get_states()


def set_tracker_rng_states(states: dict) -> None:
    """Restore :func:`tracker_rng_states`' output."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    get_cuda_rng_tracker().set_states(states)


def _ties_embeddings(chunk) -> bool:
    """Whether a model chunk (DDP, ``Float16Module``, ``GPTModel``) shares its input embedding
    and output layer weights."""
    module = chunk
    while module is not None:
        if getattr(module, "share_embeddings_and_output_weights", False):
            return True
        module = getattr(module, "module", None)
    return False


class DistCheckpoint:
    """The model chunks and the optimizer of one loop as ``dist_checkpointing`` saves and loads them.

    ``chunks``: megatron DDP models, one per virtual stage of this rank, in order. ``optimizer``:
    megatron's own (checked by :func:`robust_plugins.patches.megatron_optim.check`, refused ones
    raise), a ``torch.optim`` optimizer over the chunks' parameters, anything with
    ``sharded_state_dict``, or None (model only).
    """

    def __init__(self, chunks: list, optimizer: Any, caller: str = "MegatronCheckpointer") -> None:
        self.chunks, self.optimizer = list(chunks), optimizer
        self.disk_refusal: str | None = (megatron_optim.interleaved_disk_refusal(optimizer, len(self.chunks))
                                         if any(_ties_embeddings(c) for c in self.chunks) else None)
        """Why disk checkpoints of this loop are refused (None: they are served)."""
        self.megatron_optimizer = optimizer is not None and megatron_optim.is_megatron_optimizer(optimizer)
        if self.megatron_optimizer:
            megatron_optim.check(optimizer, caller)
            megatron_optim.install()

    def model_keys(self) -> list[str]:
        """Megatron-LM's keys: ``model`` for one chunk, ``model0``, ``model1``... for several."""
        return ["model"] if len(self.chunks) == 1 else [f"model{i}" for i in range(len(self.chunks))]

    def _model_sharded(self) -> dict:
        return {key: c.module.sharded_state_dict(prefix="") for key, c in zip(self.model_keys(), self.chunks)}

    def sharded_state_dict(self, is_loading: bool = False) -> dict:
        """The model chunks' sharded state dicts under :meth:`model_keys`, and ``optimizer``."""
        out = self._model_sharded()
        # The optimizer maps its parameters through a second, untouched copy of the model's.
        opt = self._optimizer_sharded(self._model_sharded(), is_loading)
        if opt is not None:
            out["optimizer"] = opt
        return out

    def _optimizer_sharded(self, model_sd: dict, is_loading: bool) -> Any:
        opt = self.optimizer
        if opt is None:
            return None
        if self.megatron_optimizer:
            if is_loading:
                megatron_optim.prepare_load(opt)
            # The distributed optimizer's format that loads at any data-parallel size (its default
            # in 0.16, fully_sharded_model_space, is deprecated there; dp_reshardable loads at the
            # same data-parallel size only); the others ignore it. Its save gathers the state to the
            # host: in batches (states_on_host), not one .cpu() per parameter and key.
            with contextlib.nullcontext() if is_loading else megatron_optim.states_on_host(opt):
                return opt.sharded_state_dict(model_sd, is_loading=is_loading,
                                              metadata={"distrib_optim_sharding_type": "fully_reshardable"})
        if hasattr(opt, "sharded_state_dict"):
            return opt.sharded_state_dict(model_sd, is_loading=is_loading)
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map, optim_state_to_sharding_state,
        )

        params = [p for g in opt.param_groups for p in g["params"]]
        if is_loading:
            # The load template needs every state tensor to exist; shapes are what matter.
            for p in params:
                if p not in opt.state or not opt.state[p]:
                    opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                    "exp_avg_sq": torch.zeros_like(p)}
        state = opt.state_dict()
        # megatron's helper drops excluded keys; Adam's per-parameter step counts (scalars, equal
        # on every rank) travel beside the sharded moments instead, as common state.
        steps = {pid: s["step"].clone() for pid, s in state["state"].items() if "step" in s}
        id_map = get_param_id_to_sharded_param_map(model_sd, params)
        optim_state_to_sharding_state(state, id_map, exclude_keys=("step",))
        state["param_steps"] = steps
        return state

    def save(self, directory: str) -> None:
        """``dist_checkpointing.save`` of :meth:`sharded_state_dict` into ``directory`` (collective)."""
        from megatron.core import dist_checkpointing

        dist_checkpointing.save(self.sharded_state_dict(), directory)

    def load(self, directory: str) -> None:
        """``dist_checkpointing.load`` from ``directory`` into the chunks and the optimizer
        (collective; resharded where the data-parallel size differs)."""
        from megatron.core import dist_checkpointing

        loaded = dist_checkpointing.load(self.sharded_state_dict(is_loading=True), directory)
        for key, chunk in zip(self.model_keys(), self.chunks):
            chunk.module.load_state_dict(loaded[key])
        if self.optimizer is not None:
            osd = loaded["optimizer"]
            if not hasattr(self.optimizer, "sharded_state_dict"):
                for pid, step in osd.pop("param_steps", {}).items():
                    osd["state"][pid]["step"] = step
            self.optimizer.load_state_dict(osd)
