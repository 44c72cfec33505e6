"""1-bit Adam: after a full-precision freeze phase, average Adam's momentum in 1-bit codes.

The ``sign`` codec applied to gradients (``compression.sign_mode: gradient``) costs about +14 %
validation loss on the benchmark GPT after 100 steps: a 1-bit code of a gradient drops most of its
information, and error feedback re-sends it too late (``benchmarks/sign_ablation.py``). 1-bit Adam
(Tang et al., 2021) moves the compression to where it hurts less:

1. for ``freeze_steps`` optimizer steps the host trains exactly as without the plugin (fp32
   gradient all-reduce, the user's Adam), so Adam's second moment ``v`` sees exact gradients;
2. then ``v`` is frozen, the host's gradient all-reduce is switched off, and each rank forms its
   *local* momentum ``b1 * m + (1 - b1) * g_rank`` from the shared momentum ``m`` and its own
   gradient; the ranks average that with the two-phase ``sign`` all-reduce (error feedback on the
   sending and the reducing side) and every rank applies the same Adam update with the frozen
   ``v``. The momentum is a running average, so a 1-bit code's error in it is spread over
   ``1 / (1 - b1)`` steps instead of landing in one update (+2 % loss in the same ablation).

Because the average is linear and every rank starts from the same ``m``, the result equals
``b1 * m + (1 - b1) * mean(g)`` up to the codec's error: exact Adam momentum on the averaged gradient.

This module knows nothing of DeepSpeed: a host calls :meth:`SignMomentumAdam.step` in place of the
optimizer's own step once ``freeze_steps`` steps are done, and stops reducing gradients itself
(``patches/deepspeed_onebit.py`` is the DeepSpeed binding). The optimizer's state
(``exp_avg``, the frozen ``exp_avg_sq``, ``step``) stays in the torch optimizer, so the host's
optimizer checkpoint holds it; the error-feedback residuals are in :meth:`state_dict`.
"""

from __future__ import annotations

from typing import Any

import torch

from robust_plugins.comm.collectives import compressed_all_reduce
from robust_plugins.comm.state import CompressionState
from robust_plugins.errors import UnsupportedError

#: Error-feedback key of the one flat momentum buffer.
MOMENTUM_KEY = "momentum"


def check_optimizer(optimizer: Any) -> None:
    """Raise :class:`UnsupportedError` unless ``optimizer`` is a plain fp32 ``torch.optim.Adam``/``AdamW``.

    The 1-bit step re-implements Adam's update on the optimizer's own state, so any variant whose
    update differs (AMSGrad, ``maximize``, a fused/CPU Adam with its own state layout) would
    silently train a different model.
    """
    name = type(optimizer).__name__
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        raise UnsupportedError(
            f"compression.sign_mode = 'momentum' is 1-bit Adam and needs torch.optim.Adam or torch.optim.AdamW "
            f"as the optimizer; the engine has {name}. Pass torch.optim.AdamW(...) to deepspeed.initialize "
            f"(not an 'optimizer' section that builds a fused/CPU Adam), or use sign_mode 'gradient'."
        )
    for i, group in enumerate(optimizer.param_groups):
        for flag in ("amsgrad", "maximize", "capturable", "differentiable"):
            if group.get(flag):
                raise UnsupportedError(
                    f"compression.sign_mode = 'momentum' does not support {name}({flag}=True) (param group {i}); "
                    f"its update differs from the Adam step the 1-bit mode applies. Turn {flag} off."
                )
        for p in group["params"]:
            if p.dtype != torch.float32:
                raise UnsupportedError(
                    f"compression.sign_mode = 'momentum' needs fp32 parameters (the momentum and the update "
                    f"are computed in fp32); param group {i} holds a {p.dtype} parameter of shape "
                    f"{tuple(p.shape)}. Train in fp32 or use sign_mode 'gradient'."
                )


class SignMomentumAdam:
    """The post-freeze step of 1-bit Adam over a torch ``Adam``/``AdamW`` (see the module docstring).

    Args:
        optimizer: the host's ``torch.optim.Adam`` or ``AdamW`` (checked by :func:`check_optimizer`).
        freeze_steps: optimizer steps of plain Adam before this step takes over; the frozen second
            moment is bias-corrected as Adam did at that step.
        block_size: elements per fp32 scale of the ``sign`` codes.
        group: the data-parallel process group (``None``: the default group).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, freeze_steps: int, block_size: int = 256,
                 group: Any = None):
        check_optimizer(optimizer)
        if freeze_steps < 1:
            raise UnsupportedError(f"freeze_steps = {freeze_steps}: 1-bit Adam needs at least one Adam step first.")
        self.optimizer = optimizer
        self.freeze_steps = freeze_steps
        self.group = group
        self.state = CompressionState(codec="sign", block_size=block_size, error_feedback=True)
        """The sending and reducing side's residuals of the momentum all-reduce."""
        self.steps_taken = 0
        """1-bit steps run by this process (not training state; for logs and tests)."""

    def _params(self) -> list[tuple[dict, torch.Tensor]]:
        return [(g, p) for g in self.optimizer.param_groups for p in g["params"] if p.requires_grad]

    @torch.no_grad()
    def step(self) -> None:
        """One 1-bit Adam step: local momentum, sign all-reduce, Adam update with the frozen ``v``.

        Every rank must call it at the same step (a collective). Parameters without a gradient
        (``p.grad is None``) contribute a zero gradient, so all ranks send the same layout.
        """
        pairs = self._params()
        opt_state = self.optimizer.state
        missing = [tuple(p.shape) for _, p in pairs if "exp_avg_sq" not in opt_state[p]]
        if missing:
            raise UnsupportedError(
                f"1-bit Adam step with no Adam state for {len(missing)} parameter(s) (first shape {missing[0]}): "
                f"the optimizer never stepped them during the {self.freeze_steps} freeze steps (a parameter "
                f"without gradients then, or optimizer state not loaded). Every trained parameter needs a "
                f"gradient during the freeze phase."
            )
        local = []
        for group, p in pairs:
            b1 = group["betas"][0]
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            if group["weight_decay"] and not self._decoupled(group):
                g = g.add(p, alpha=group["weight_decay"])  # Adam's L2 term goes into the gradient
            local.append((opt_state[p]["exp_avg"] * b1).add_(g, alpha=1 - b1).reshape(-1))
        flat = torch.cat(local)
        compressed_all_reduce(flat, group=self.group, op="avg", state=self.state, key=MOMENTUM_KEY)
        for (_, p) in pairs:
            opt_state[p]["step"] += 1
        offset = 0
        for (group, p), t in zip(pairs, _as_floats([opt_state[p]["step"] for _, p in pairs])):
            st = opt_state[p]
            b1, b2 = group["betas"]
            m = st["exp_avg"]
            m.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
            if group["weight_decay"] and self._decoupled(group):
                p.mul_(1 - group["lr"] * group["weight_decay"])
            # Same arithmetic as torch's single-tensor Adam, with v's bias correction frozen at the
            # step v was frozen (its value no longer moves; correcting with the live step would
            # grow every update by 1 / sqrt(1 - b2**freeze_steps), 1.25x for b2 = 0.95 and 20 steps).
            denom = (st["exp_avg_sq"].sqrt() / (1 - b2 ** self.freeze_steps) ** 0.5).add_(group["eps"])
            p.addcdiv_(m, denom, value=-group["lr"] / (1 - b1 ** t))
        self.steps_taken += 1

    def _decoupled(self, group: dict) -> bool:
        # AdamW always decouples; torch >= 2.5 Adam can too (decoupled_weight_decay=True).
        return isinstance(self.optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False))

    def state_dict(self) -> dict:
        """The error-feedback residuals (the optimizer state is the host's to save)."""
        return {"freeze_steps": self.freeze_steps, "residuals": self.state.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        """Restore :meth:`state_dict`; the freeze length must match (it sets the frozen ``v``'s scale)."""
        if sd.get("freeze_steps") != self.freeze_steps:
            from robust_plugins.errors import CheckpointError

            raise CheckpointError(
                f"the checkpoint's 1-bit Adam ran with freeze_steps = {sd.get('freeze_steps')!r}, this job with "
                f"{self.freeze_steps}; resume with the checkpoint's freeze_steps."
            )
        self.state.load_state_dict(sd["residuals"])


def _as_floats(steps: list) -> list[float]:
    """Adam's per-parameter step counts as Python floats, with at most one device-to-host copy.

    torch keeps ``step`` on the host unless the optimizer is ``capturable`` or ``fused``; then it
    lives on the GPU and a ``float()`` per parameter would be one synchronisation each. The values
    (and so the update's arithmetic) are the same either way.
    """
    on_device = [s for s in steps if isinstance(s, torch.Tensor) and s.device.type != "cpu"]
    if not on_device:
        return [float(s) for s in steps]
    device = on_device[0].device
    stacked = torch.stack([torch.as_tensor(s, dtype=torch.float64).to(device) for s in steps]).cpu()
    return stacked.tolist()
