"""``robust prebuild``: build DeepSpeed's CPU comm extension once, at install time.

The first ``deepspeed.initialize`` on a CPU machine JIT-builds ``deepspeed_shm_comm`` (30-120 s);
doing it inside a test or a 4-rank launch builds it several times at once (../shared/HOSTS.md).
"""

from __future__ import annotations

import argparse
import os
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options."""


def run(args: argparse.Namespace) -> int:
    """Build (or load from the cache) the CPU shared-memory comm op."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    t0 = time.perf_counter()
    try:
        from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder
    except ImportError:
        print("robust prebuild: DeepSpeed is not installed; nothing to build.")
        return 0
    ShareMemCommBuilder().load()
    cache = os.environ.get("TORCH_EXTENSIONS_DIR", "~/.cache/torch_extensions")
    print(f"robust prebuild: deepspeed_shm_comm ready in {time.perf_counter() - t0:.1f} s (cache: {cache})")
    return 0
