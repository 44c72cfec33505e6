"""Where does the ``sign`` codec's loss go? An ablation in one process.

``robust bench compression`` measures the ``sign`` codec (1 bit an element plus one fp32 scale a
256-element block, error feedback on the sending and the reducing side) at about +14 % validation
loss against vanilla DeepSpeed after 100 steps of the text GPT, against a 5 % target. This script
separates the candidate causes by training the same GPT with W simulated data-parallel ranks in
one process (each rank's gradient from its own micro-batch, exactly as the recipe draws them), so
that each variant differs from the others in one thing only:

``fp32``         the exact average of the ranks' gradients, ``torch.optim.AdamW`` (the reference);
``fp32-blockv``  the exact average, but Adam's second moment kept per 256-element block instead of
                 per element (what Adam sees when every element of a block arrives with the same
                 magnitude, as 1-bit codes do); a hand-written Adam with the same betas;
``sign-send``    only the sending side is 1-bit (with error feedback); the sum is exact fp32;
``sign``         the codec as shipped: :func:`robust_plugins.comm._twophase.simulate_all_reduce`,
                 the same arithmetic as the collective (both sides 1-bit, both error feedbacks);
``sign-rotated`` as ``sign``, but every 256-element block is first rotated by a fixed random
                 orthogonal transform (random signs, then a Walsh-Hadamard transform), which makes
                 blocks Gaussian-like so that one mean-magnitude scale fits them better;
``sign-momentum`` 1-bit Adam (``compression.sign_mode: momentum``): exact averages and AdamW for
                 ``--freeze-steps`` steps, then each rank clips its own gradient, forms its local
                 momentum from the shared one and the ranks average that with the shipped two-phase
                 sign arithmetic; Adam's second moment stays frozen (the update of
                 :class:`robust_plugins.comm.momentum.SignMomentumAdam`, written out here over W
                 simulated ranks).

Run (each variant ~1-2 min on 2 CPU cores, one seed)::

    python benchmarks/sign_ablation.py --steps 150 --variants fp32 fp32-blockv sign-send sign sign-rotated
    python benchmarks/sign_ablation.py --steps 100 --variants fp32 sign-momentum --freeze-steps 20

It prints one JSON line per variant and a table of validation loss relative to ``fp32``.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from robust_plugins.comm._twophase import encode, plan, simulate_all_reduce, unpack
from robust_plugins.workloads import build_gpt, get_batch, load_corpus
from triton_ops import reference as ref

VARIANTS = ("fp32", "fp32-blockv", "sign-send", "sign", "sign-rotated", "sign-momentum")
BLOCK = 256


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal fast Walsh-Hadamard transform over the last dimension (a power of two)."""
    d, h, y = x.shape[-1], 1, x
    while h < d:
        y = y.reshape(*x.shape[:-1], d // (2 * h), 2, h)
        y = torch.stack((y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]), dim=-2)
        h *= 2
    return y.reshape(x.shape) / math.sqrt(d)


class Reducer:
    """The gradient average of one variant, with its error-feedback residuals."""

    def __init__(self, variant: str, numel: int, world: int) -> None:
        self.variant, self.numel, self.world = variant, numel, world
        self.padded = -(-numel // BLOCK) * BLOCK
        n = self.padded if variant == "sign-rotated" else numel
        self.send = [torch.zeros(n) for _ in range(world)]
        self.serv = [torch.zeros(plan(n, world, "sign", BLOCK).chunk) for _ in range(world)]
        gen = torch.Generator().manual_seed(1234)
        self.flip = (torch.randint(0, 2, (self.padded,), generator=gen) * 2 - 1).float()

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.pad(x, (0, self.padded - self.numel)) * self.flip
        return hadamard(x.view(-1, BLOCK)).reshape(-1)

    def unrotate(self, y: torch.Tensor) -> torch.Tensor:
        # The transform is its own inverse (orthonormal and symmetric); then undo the sign flips.
        return (hadamard(y.view(-1, BLOCK)).reshape(-1) * self.flip)[: self.numel]

    def __call__(self, grads: list[torch.Tensor]) -> torch.Tensor:
        if self.variant in ("fp32", "fp32-blockv"):
            return torch.stack(grads).mean(0)
        if self.variant == "sign-send":
            layout = plan(self.numel, 1, "sign", BLOCK)
            decoded = []
            for r, g in enumerate(grads):
                codes, scales = unpack(encode(g, layout, self.send[r])[0], layout)
                decoded.append(ref.dequantize(codes, scales, codec="sign", block_size=BLOCK, numel=self.numel))
            return torch.stack(decoded).mean(0)
        if self.variant == "sign":
            return simulate_all_reduce(grads, codec="sign", block_size=BLOCK,
                                       sender_residuals=self.send, server_residuals=self.serv)
        rotated = simulate_all_reduce([self.rotate(g) for g in grads], codec="sign", block_size=BLOCK,
                                      sender_residuals=self.send, server_residuals=self.serv)
        return self.unrotate(rotated)


def block_v_adam_step(params, state, step: int, lr: float, betas: tuple[float, float], eps: float = 1e-8) -> None:
    """Adam whose second moment is one number per 256-element block of each parameter."""
    b1, b2 = betas
    for p in params:
        g = p.grad.reshape(-1)
        k = min(BLOCK, g.numel())
        nb = -(-g.numel() // k)
        counts = torch.full((nb,), float(k))
        counts[-1] = g.numel() - (nb - 1) * k
        st = state.setdefault(p, {"m": torch.zeros_like(g), "v": torch.zeros(nb)})
        st["m"].mul_(b1).add_(g, alpha=1 - b1)
        sq = torch.nn.functional.pad(g * g, (0, nb * k - g.numel())).view(nb, k).sum(1) / counts
        st["v"].mul_(b2).add_(sq, alpha=1 - b2)
        v = st["v"].repeat_interleave(k)[: g.numel()]
        m_hat, v_hat = st["m"] / (1 - b1 ** step), v / (1 - b2 ** step)
        p.data.add_((-lr * m_hat / (v_hat.sqrt() + eps)).view_as(p))


def momentum_sign_step(params, opt, grads, reducer, freeze: int, lr: float, betas: tuple[float, float],
                       eps: float = 1e-8) -> None:
    """One 1-bit Adam step after the freeze: sign-compress each rank's local momentum, v frozen.

    Each rank clips its own gradient (the engine clips before the optimizer, and after the freeze
    it no longer all-reduces), forms ``b1 * m + (1 - b1) * g_rank`` from the shared momentum
    ``m`` and sends that through the two-phase sign all-reduce (both error feedbacks); every
    rank then applies the same Adam update with the second moment frozen at the freeze step.
    """
    b1, b2 = betas
    m = torch.cat([opt.state[p]["exp_avg"].reshape(-1) for p in params])
    v = torch.cat([opt.state[p]["exp_avg_sq"].reshape(-1) for p in params])
    local = []
    for g in grads:
        g = g * min(1.0, 1.0 / (float(g.norm()) + 1e-6))
        local.append(b1 * m + (1 - b1) * g)
    m_new = simulate_all_reduce(local, codec="sign", block_size=BLOCK,
                                sender_residuals=reducer.send, server_residuals=reducer.serv)
    t = int(opt.state[params[0]]["step"]) + 1
    v_hat = v / (1 - b2 ** freeze)
    update = (m_new / (1 - b1 ** t)) / (v_hat.sqrt() + eps)
    off = 0
    for p in params:
        n = p.numel()
        opt.state[p]["exp_avg"].copy_(m_new[off : off + n].view_as(p))
        opt.state[p]["step"].fill_(t)
        p.data.add_(update[off : off + n].view_as(p), alpha=-lr)
        off += n


def train(variant: str, args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    corpus = load_corpus()
    model = build_gpt(args.preset, args.seed)
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    betas = (0.9, 0.95)  # the recipe's AdamW settings
    opt = torch.optim.AdamW(params, lr=args.lr, betas=betas, weight_decay=0.0)
    reducer, adam_state = Reducer(variant, numel, args.world), {}
    losses, t0 = [], time.perf_counter()
    for step in range(args.steps):
        grads, loss_sum = [], 0.0
        for r in range(args.world):
            x, y = get_batch(corpus, "train", seed=args.seed, step=step, rank=r, world_size=args.world,
                             micro_batch=args.micro_batch, seq_len=model.cfg.seq_len)
            model.zero_grad(set_to_none=True)
            loss = model(x, y)
            loss.backward()
            loss_sum += loss.item() / args.world
            grads.append(torch.cat([p.grad.reshape(-1) for p in params]))
        if variant == "sign-momentum" and step >= args.freeze_steps:
            momentum_sign_step(params, opt, grads, reducer, args.freeze_steps, args.lr, betas)
            losses.append(loss_sum)
            continue
        avg, off = (torch.stack(grads).mean(0) if variant == "sign-momentum" else reducer(grads)), 0
        for p in params:
            p.grad = avg[off : off + p.numel()].view_as(p).clone()
            off += p.numel()
        torch.nn.utils.clip_grad_norm_(params, 1.0)  # the recipe's gradient_clipping
        if variant == "fp32-blockv":
            block_v_adam_step(params, adam_state, step + 1, args.lr, betas)
        else:
            opt.step()
        losses.append(loss_sum)
    with torch.no_grad():
        val = sum(model(*get_batch(corpus, "val", seed=0, step=i, rank=0, world_size=1, micro_batch=32,
                                   seq_len=model.cfg.seq_len)).item() for i in range(8)) / 8
    return {"variant": variant, "steps": args.steps, "seed": args.seed, "val_loss": val,
            "train_loss_last10": sum(losses[-10:]) / 10, "seconds": time.perf_counter() - t0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--world", type=int, default=4, help="simulated data-parallel ranks (default 4)")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--preset", default="small")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--freeze-steps", type=int, default=20,
                   help="sign-momentum: full-precision Adam steps before the momentum is sent as sign codes")
    args = p.parse_args()
    torch.set_num_threads(1)
    results = []
    for v in args.variants:
        results.append(train(v, args))
        print(json.dumps(results[-1]), flush=True)
    base = next((r["val_loss"] for r in results if r["variant"] == "fp32"), None)
    print(f"\n| variant | val loss after {args.steps} steps | vs fp32 |\n|---|---|---|")
    for r in results:
        rel = f"{100 * (r['val_loss'] / base - 1):+.1f} %" if base else "n/a"
        print(f"| {r['variant']} | {r['val_loss']:.4f} | {rel} |")


if __name__ == "__main__":
    main()
