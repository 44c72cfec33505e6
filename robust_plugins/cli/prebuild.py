"""``robust prebuild``: build DeepSpeed's CPU comm extension once, at install time, so that ranks
starting together load it instead of each building it (:mod:`robust_plugins.patches.deepspeed_prebuild`).
"""

from __future__ import annotations

import argparse
import os
import time

from robust_plugins.patches.deepspeed_prebuild import build_cpu_comm


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options."""


def run(args: argparse.Namespace) -> int:
    """Build (or load from the cache) the CPU shared-memory comm op."""
    t0 = time.perf_counter()
    if not build_cpu_comm():
        print("robust prebuild: DeepSpeed is not installed; nothing to build.")
        return 0
    cache = os.environ.get("TORCH_EXTENSIONS_DIR", "~/.cache/torch_extensions")
    print(f"robust prebuild: deepspeed_shm_comm ready in {time.perf_counter() - t0:.1f} s (cache: {cache})")
    return 0
