"""DeepSpeed's CPU shared-memory comm extension, built before the first ``deepspeed.initialize``.

The first ``deepspeed.initialize`` on a CPU machine JIT-builds ``deepspeed_shm_comm``; ranks that
start together would each build it at once. Building it once at install time fills the torch
extension cache they all load from. Nothing is replaced: this only calls DeepSpeed's op builder.
"""

from __future__ import annotations

import os


def build_cpu_comm() -> bool:
    """Build ``deepspeed_shm_comm`` (or load it from the torch extension cache), for the CPU
    accelerator (``DS_ACCELERATOR=cpu`` unless already set). False, with nothing built, when
    DeepSpeed is not installed; a failing build raises DeepSpeed's own error."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder
    except ImportError:
        return False
    ShareMemCommBuilder().load()
    return True
