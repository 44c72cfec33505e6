"""``ShardedAdamW``: AdamW on this rank's shard of megatron's buffers, moments saved in model space.

An option of the megatron_gpt recipe (``--optimizer sharded-adamw``), not its default: the recipe
runs megatron-core's own optimizers (``get_megatron_optimizer``). It stays for loops that want a
plain ``torch.optim.AdamW`` over megatron's distributed-optimizer buffers whose checkpoint loads
at any data-parallel size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class ShardedAdamW:
    """AdamW on this rank's shard of megatron's buffers (``use_distributed_optimizer`` DDP).

    With ``use_distributed_optimizer`` megatron's DDP does the distributed part: parameters live in one contiguous
    buffer per dtype, and each bucket's gradients are reduce-scattered so that data-parallel rank r
    holds the reduced gradients of shard r. This class steps a ``torch.optim.AdamW`` over those
    shards only (each rank keeps 1/dp of the moments, as a distributed optimizer does), then
    megatron's ``start_param_sync`` all-gathers the updated parameters. Its optimizer state is
    checkpointed in model space: :meth:`sharded_state_dict` gives one ``ShardedTensor`` per
    parameter and moment, so a checkpoint resumes at another data-parallel size.
    """

    def __init__(self, ddp, lr: float, dp_rank: int, dp_size: int):
        from megatron.core.distributed.param_and_grad_buffer import shard_buffer

        self.ddp, self.dp_rank, self.dp_size = ddp, dp_rank, dp_size
        self.params: list[torch.nn.Parameter] = []
        self._grads: list[torch.Tensor] = []
        for buffer in ddp.buffers:
            for bucket in buffer.buckets:
                # Parameter() of a view aliases its storage: stepping it updates megatron's buffer.
                self.params.append(torch.nn.Parameter(shard_buffer(bucket.param_data, dp_size)[dp_rank]))
                self._grads.append(shard_buffer(bucket.grad_data, dp_size)[dp_rank])
        self.opt = torch.optim.AdamW(self.params, lr=lr, weight_decay=0.0)

    def zero_grad(self) -> None:
        """Nothing to do: the gradient shards are views of megatron's buffer (``zero_grad_buffer``)."""

    def step(self) -> None:
        """AdamW on the local shards (after ``finish_grad_sync``), then all-gather the parameters."""
        for p, g in zip(self.params, self._grads):
            p.grad = g
        self.opt.step()
        self.ddp.start_param_sync(force_sync=True)

    def _ensure_state(self) -> None:
        for p in self.params:
            if not self.opt.state[p]:
                self.opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                     "exp_avg_sq": torch.zeros_like(p)}

    def _layout(self) -> list[tuple[int, torch.nn.Parameter, int, int]]:
        """(bucket index, parameter, start, end) of every parameter, positions in its bucket."""
        out, i = [], 0
        for buffer in self.ddp.buffers:
            for bucket in buffer.buckets:
                for p in bucket.params_list:
                    start, end, _ = buffer.param_index_map[p]
                    out.append((i, p, start - bucket.offset, end - bucket.offset))
                i += 1
        return out

    def sharded_state_dict(self, model_sd: dict, is_loading: bool = False) -> dict:
        """dist_checkpointing view of the moments in model space: one tensor per parameter and moment.

        Keyed and sharded like the parameter itself (``optimizer.state.<moment>.<param key>``,
        data-parallel rank 0 the main replica), never by bucket: bucket sizes and padding
        depend on the data-parallel size, parameters do not, so a checkpoint written at one
        data-parallel size loads at another (megatron's "fully_reshardable" idea). Saving
        all-gathers each bucket's moments over the data-parallel group (collective).
        """
        from megatron.core import parallel_state as ps
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map, make_sharded_optimizer_tensor,
        )

        self._ensure_state()
        full: dict[tuple[int, str], torch.Tensor] = {}
        for i, p in enumerate(self.params):
            for name in ("exp_avg", "exp_avg_sq"):
                shard = self.opt.state[p][name]
                whole = torch.zeros(shard.numel() * self.dp_size, dtype=shard.dtype, device=shard.device)
                if not is_loading:  # a load only needs the template's shapes
                    dist.all_gather_into_tensor(whole, shard.contiguous(), group=ps.get_data_parallel_group())
                full[(i, name)] = whole
        layout = self._layout()
        id_map = get_param_id_to_sharded_param_map(model_sd, [p for _, p, _, _ in layout])
        moments = {}
        for pid, (i, p, start, end) in enumerate(layout):
            for name in ("exp_avg", "exp_avg_sq"):
                moments[f"{pid}.{name}"] = make_sharded_optimizer_tensor(
                    id_map[pid], full[(i, name)][start:end].view(p.shape), f"optimizer.state.{name}")
        steps = {float(self.opt.state[p]["step"]) for p in self.params}
        if len(steps) != 1:
            raise RuntimeError(f"ShardedAdamW: buckets stepped different numbers of times {sorted(steps)}")
        return {"moments": moments, "step": self.opt.state[self.params[0]]["step"].clone(),
                "lr": [g["lr"] for g in self.opt.param_groups]}

    def load_state_dict(self, sd: dict) -> None:
        """Restore what :meth:`sharded_state_dict` saved (as loaded by ``dist_checkpointing.load``):
        each rank copies its shard of every bucket out of the per-parameter moments."""
        from megatron.core.distributed.param_and_grad_buffer import shard_buffer

        self._ensure_state()
        layout = self._layout()
        for i, p in enumerate(self.params):
            for name in ("exp_avg", "exp_avg_sq"):
                shard = self.opt.state[p][name]
                whole = torch.zeros(shard.numel() * self.dp_size, dtype=shard.dtype, device=shard.device)
                for pid, (j, param, start, end) in enumerate(layout):
                    if j == i:
                        whole[start:end] = sd["moments"][f"{pid}.{name}"].reshape(-1)
                shard.copy_(shard_buffer(whole, self.dp_size)[self.dp_rank])
            self.opt.state[p]["step"] = sd["step"].clone()
        for g, lr in zip(self.opt.param_groups, sd["lr"]):
            g["lr"] = lr
