"""How the DeepSpeed test workers end: without the interpreter's teardown.

A DeepSpeed+gloo rank sometimes aborts in interpreter teardown after its work is done
(``terminate called without an active exception``, exit -6, no traceback; with or without the
plugin, docs/hf_trainer.md). CI saw it in ``ds_worker.py`` and, after ``destroy_process_group``
had run, in ``ds_checkpoint_worker.py`` (once in CI; not reproduced in 51 local runs). The tests judge the results file each worker writes before it calls this; an abort
during the work still fails the launch, with each rank's last lines in the error.

Skipping the teardown also skips the plugin's exit handler, which outside ``robust run`` removes
the job's in-memory snapshot files: every `make test` left 40 files in ``/dev/shm`` (12 for each
ZeRO stage of ``test_deepspeed_memory.py``, 4 from ``test_deepspeed_onebit.py``; 2.5 MB each here,
GBs for a real model). They are removed here instead.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def leave_without_teardown() -> NoReturn:
    """Wait for the other ranks (a rank gone early breaks their last collectives), then exit 0."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    _remove_snapshots()
    sys.stdout.flush()
    sys.stderr.flush()
    if os.environ.get("ROBUST_TEST_FORKED_RANK"):
        os.environ["ROBUST_TEST_LEFT_WITHOUT_TEARDOWN"] = "1"
        # A rank forked by tests/_dist.run_script reports back to its parent and then leaves
        # with os._exit itself (multiprocessing's child exit): no interpreter teardown either.
        raise SystemExit(0)
    os._exit(0)


def _remove_snapshots() -> None:
    """What the plugin's exit handler does on a normal end outside ``robust run`` (under it, the
    launcher removes them when the job completes): every rank removes the job's files, after the
    barrier, so no rank still reads one."""
    if os.environ.get("ROBUST_RUN_DIR"):
        return
    from robust_plugins.checkpoint import memory
    from robust_plugins.errors import RobustPluginsError

    try:
        key = memory.job_key()
    except RobustPluginsError:  # no stable job id: this run had no snapshots
        return
    memory.remove_job(key)
