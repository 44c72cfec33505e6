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
    DeepSpeed is not installed; a DeepSpeed the plugin does not support raises the
    :class:`HostVersionError` naming its version (the build would serve no plugin run); a failing
    build raises DeepSpeed's own error."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed  # noqa: F401  (its own import errors are not "not installed")
    except ModuleNotFoundError as exc:
        if exc.name != "deepspeed":
            raise
        return False
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    from robust_plugins.patches.deepspeed import host_problem

    problem = host_problem()
    if problem is not None:
        raise problem
    ShareMemCommBuilder().load()
    return True
