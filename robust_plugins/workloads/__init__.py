"""Deterministic training workloads for recipes, tests, the demo and benchmarks.

Nothing here is downloaded: the text is the running interpreter's own standard library, and the
model is a small GPT in plain PyTorch. Both are pure functions of their seeds, so two runs (or a
run and its resumption from a checkpoint) can be compared bitwise.
"""

from __future__ import annotations

from robust_plugins.workloads.gpt import GPT, PRESETS, GPTConfig, build_gpt
from robust_plugins.workloads.text import TextCorpus, get_batch, load_corpus

__all__ = ["GPT", "GPTConfig", "PRESETS", "TextCorpus", "build_gpt", "get_batch", "load_corpus"]
