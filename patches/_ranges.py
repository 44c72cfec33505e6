"""The host versions each patch was tested on, in one table (a leaf: imports no host, no torch).

The patches check them (``_guard.HostRange``); ``robust check-config`` compares them with what is
installed without importing the hosts; pyproject's extras name the same ranges
(tests/unit/test_host_ranges.py holds them equal).
"""

from __future__ import annotations

from robust_plugins.patches._guard import HostRange

DEEPSPEED = HostRange(
    "deepspeed", (0, 19, 0), (0, 20, 0),
    instead="remove the robust_plugins block from your DeepSpeed config (without it DeepSpeed runs unchanged)")

MEGATRON = HostRange(
    "megatron-core", (0, 16, 0), (0, 17, 0),
    instead=("do not call robust_plugins.megatron's enable (rpm.enable), MegatronCheckpointer or the CPU "
             "shim (without them megatron-core runs unchanged)"),
    note=("megatron-core 0.17 and newer need Python >= 3.12 and were not tested (the development machines "
          "run Python 3.11)."))

TRANSFORMERS = HostRange(
    "transformers", (5, 24, 0), (5, 25, 0),
    instead=("remove the checkpoint sub-block from the Trainer's DeepSpeed config (use the Trainer's own "
             "save_strategy / resume_from_checkpoint)"))

ACCELERATE = HostRange(
    "accelerate", (1, 15, 0), (1, 16, 0),
    instead=("remove the checkpoint sub-block from the DeepSpeed config of your Accelerate loop (use "
             "Accelerate's save_state / load_state)"))

#: torch's elastic agent, which ``robust run`` subclasses (``patches/torch_elastic.py``). The
#: project never replaces a user's torch: the alternative is plain torchrun.
TORCH_ELASTIC = HostRange(
    "torch", (2, 4, 0), (2, 15, 0),
    instead=("use an environment whose torch is in this range, or launch with plain torchrun (no watchdog, "
             "no gloo restarts); robust_plugins never replaces your torch"), pip=False)

ALL = {r.host: r for r in (DEEPSPEED, MEGATRON, TRANSFORMERS, ACCELERATE, TORCH_ELASTIC)}
