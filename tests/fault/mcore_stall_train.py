"""The megatron_gpt recipe with one rank stalled inside a pipeline stage's forward, for the
pipeline hang test.

Run as the recipe: ``torchrun ... mcore_stall_train.py --stall-rank R --stall-step S <recipe args>``.
Rank ``R`` sleeps (a Python loop, as ``--inject hang`` does) in its model chunk's forward of the
first micro-batch of step ``S``: mid-schedule, so its pipeline neighbour waits in megatron's p2p
(the activation it should send, or the gradient it should return), not in a collective at the
step's end.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from robust_plugins.recipes.megatron_gpt import train as recipe


def stalling(rank: int, step: int):
    """``recipe.build`` and ``recipe.train_step`` wrapped: rank ``rank``'s forward never returns
    at ``step``."""
    build, train_step = recipe.build, recipe.train_step
    now = {"step": 0}

    def train_step_noting(parts, preset, corpus, seed, s, *a, **kw):
        now["step"] = s
        return train_step(parts, preset, corpus, seed, s, *a, **kw)

    def build_stalling(*a, **kw):
        parts = build(*a, **kw)
        ddp = parts["ddp"]
        forward = ddp.forward

        def forward_or_stall(*fa, **fkw):
            if now["step"] == step and int(os.environ["RANK"]) == rank:
                print(f"rank {rank} stalls in its forward of step {step}", flush=True)
                while True:  # killed by robust run after the hang verdict
                    time.sleep(0.05)
            return forward(*fa, **fkw)

        ddp.forward = forward_or_stall
        return parts

    return build_stalling, train_step_noting


def main() -> int:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--stall-rank", type=int, required=True)
    p.add_argument("--stall-step", type=int, required=True)
    args, rest = p.parse_known_args()
    recipe.build, recipe.train_step = stalling(args.stall_rank, args.stall_step)
    return recipe.main(rest)


if __name__ == "__main__":
    sys.exit(main())
