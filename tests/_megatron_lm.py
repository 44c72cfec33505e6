"""Shared pieces of the tests that run Megatron-LM's own ``pretrain_gpt.py`` (a checkout named by
``MEGATRON_LM_PATH``; skipped without one): the tiny model's arguments and checkpoint readers."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest
import torch

CHECKOUT = os.environ.get("MEGATRON_LM_PATH", "")
SCRIPT = str(Path(CHECKOUT) / "pretrain_gpt.py") if CHECKOUT else ""


def skip_without_checkout():
    """Skip unless ``MEGATRON_LM_PATH`` names a Megatron-LM checkout this environment can run."""
    if not CHECKOUT:
        pytest.skip("MEGATRON_LM_PATH is not set: these tests run Megatron-LM's pretrain_gpt.py from a checkout "
                    "(git clone -b core_v0.16.1 https://github.com/NVIDIA/Megatron-LM; not on the registry)")
    if not os.path.isfile(SCRIPT):
        pytest.skip(f"MEGATRON_LM_PATH={CHECKOUT} has no pretrain_gpt.py")
    if importlib.util.find_spec("six") is None:
        pytest.skip("Megatron-LM's tokenizer imports six, which is not installed (pip install six)")
    pytest.importorskip("megatron.core")


def gpt_args(steps: int) -> list[str]:
    """A 2-layer GPT (hidden 64) on mock data over gloo, local layers, no fused kernels."""
    return ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
            f"--micro-batch-size 2 --global-batch-size 8 --train-iters {steps} --lr 1e-3 --min-lr 1e-4 "
            "--lr-decay-style cosine --mock-data --tokenizer-type NullTokenizer --vocab-size 128 "
            "--distributed-backend gloo --transformer-impl local --no-gradient-accumulation-fusion "
            "--no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion --no-rope-fusion "
            "--no-persist-layer-norm --log-interval 1 --eval-iters 0 --eval-interval 1000 --seed 1234 "
            "--split 100,0,0 --num-workers 0 --ckpt-format torch").split()


def saved_states(folder: Path, step: int) -> dict[str, dict]:
    """Megatron-LM's torch-format checkpoint of ``step`` (model, optimizer, RNG), one per saved
    shard folder (``mp_rank_00``; ``mp_rank_00_000``, ``mp_rank_00_001``... with expert parallelism)."""
    return {p.parent.name: torch.load(p, map_location="cpu", weights_only=False)
            for p in sorted((folder / f"iter_{step:07d}").glob("mp_rank_*/model_optim_rng.pt"))}


def saved_state(folder: Path, step: int) -> dict:
    """:func:`saved_states` of a job without expert parallelism (its one shard folder)."""
    (state,) = saved_states(folder, step).values()
    return state


def tensors(value, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor inside ``value`` (dicts and lists), by its path."""
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    out: dict[str, torch.Tensor] = {}
    for key, item in items:
        out.update(tensors(item, f"{prefix}/{key}"))
    return out


def losses(log: str) -> dict[int, float]:
    """``lm loss`` of each iteration Megatron-LM logged (the last line of each iteration wins)."""
    out = {}
    for m in re.finditer(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)", log):
        out[int(m.group(1))] = float(m.group(2))
    return out
