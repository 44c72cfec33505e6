"""The megatron_gpt recipe with a loss that depends on RNG state, for the megatron resume tests.

Run as the recipe: ``torchrun ... mcore_rng_train.py --noise all|torch <recipe args>``. The recipe's
presets have no dropout, so a resume that forgot the RNG states would still end bitwise equal.
Here every forward's loss is scaled by ``1 + 0.05 * noise``, ``noise`` drawn from torch's default
generator and megatron's model-parallel tracker stream (``--noise torch``: what the disk
checkpoint restores) and, with ``--noise all``, from numpy and Python's ``random`` too (what an
in-memory snapshot restores). numpy and Python are seeded per rank here; torch and the tracker by
the recipe's ``build``. A resumed run then matches the uninterrupted one only if every rank's
states came back.
"""

from __future__ import annotations

import argparse
import os
import random
import sys

import numpy as np
import torch

from robust_plugins.recipes.megatron_gpt import train as recipe

_STREAM = "model-parallel-rng"  # megatron's tensor-parallel stream (model_parallel_cuda_manual_seed)


def noisy_build(kinds: str):
    """``recipe.build`` whose DDP forward scales the loss by the RNG draws of ``kinds``."""
    original = recipe.build

    def build(*args, **kwargs):
        parts = original(*args, **kwargs)
        ddp = parts["ddp"]
        forward = ddp.forward

        def forward_with_noise(*a, **kw):
            from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

            # one draw from the default generator and one from the tracker's model-parallel
            # stream (through get_states/set_states: its fork() warns on CPU, where the shim
            # makes the CUDA generator the CPU one)
            tracker = get_cuda_rng_tracker()
            states = tracker.get_states()
            stream = torch.Generator()
            stream.set_state(states[_STREAM])
            noise = torch.rand(()) + torch.rand((), generator=stream)
            states[_STREAM] = stream.get_state()
            tracker.set_states(states)
            if kinds == "all":
                noise = noise + float(np.random.rand()) + random.random()
            return forward(*a, **kw) * (1 + 0.05 * noise)

        ddp.forward = forward_with_noise
        return parts

    return build


def main() -> int:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--noise", choices=("all", "torch"), required=True)
    args, rest = p.parse_known_args()
    seed = 100 + int(os.environ.get("RANK", "0"))
    np.random.seed(seed)
    random.seed(seed)
    recipe.build = noisy_build(args.noise)
    return recipe.main(rest)


if __name__ == "__main__":
    sys.exit(main())
