"""Emergency checkpoints: one live rank commits a verified checkpoint alone, with no collective.

When a peer rank dies, the live ranks' next collective fails (``robust_plugins.watchdog.on_emergency``
calls their saver then). A normal save cannot run: every step of :class:`DiskCheckpointer`'s
protocol (and DeepSpeed's ``save_checkpoint``, and megatron-core's ``dist_checkpointing.save``)
waits for every rank, the dead one included. What can still be saved is what one rank holds in
full: a replicated state (plain data parallelism, DeepSpeed ZeRO 0). :func:`plan` decides that
from the layout (a pure function, unit-tested); :func:`commit_alone` writes and commits it:

1. the committed ``<tag>`` exists already (a periodic save of the same step): nothing to do;
2. renaming a private directory to ``<root>/.tmp-emergency-<tag>`` elects the writer: the rename
   is atomic and fails once the name holds a (non-empty) directory, so of several live ranks
   exactly one writes, without talking to the others (they return "rank N writes it");
3. the host writes its files into that directory; each is fsynced and hashed, the manifest
   (same format, world size and layout as a normal save of this job, so the restarted job loads
   it like any other) is written last, the directory renamed to ``<tag>`` and ``latest`` updated.

A writer that dies half-way leaves only the ``.tmp-`` directory, which loading skips and the next
save's pruning removes. Nothing here knows about DeepSpeed or torch.distributed.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any, Callable, Mapping

from robust_plugins.checkpoint import store
from robust_plugins.checkpoint.manifest import (
    MANIFEST_NAME, Manifest, describe_files, fsync_dir, fsync_file, list_files, write_manifest,
)
from robust_plugins.errors import CheckpointError

#: Prefix of the writer's staging directory (a ``.tmp-`` name, so loading skips it and pruning
#: removes a leftover); distinct from a normal save's ``.tmp-<tag>`` that the crash may have left.
STAGING_PREFIX = store.TMP_PREFIX + "emergency-"


class EmergencySkip(CheckpointError):
    """An emergency save that cannot be made (the reason is the message)."""


def plan(*, zero_stage: int, model_parallel: int = 1, has_residuals: bool = False,
         host: str = "DeepSpeed") -> str | None:
    """Why one live rank cannot save a state that restores every rank, or None when it can.

    ``zero_stage``: DeepSpeed's ZeRO stage (0 for a replicated optimizer, as megatron-core's with a
    ``torch.optim`` optimizer is; 1 for megatron-core's distributed optimizer). ``host`` names the
    framework in the reason. ``model_parallel``: tensor x pipeline parallel size.
    ``has_residuals``: per-rank compression error-feedback residuals are part of the state.
    """
    if model_parallel > 1:
        return (f"{host} model parallelism ({model_parallel} model-parallel ranks) splits the model "
                f"across ranks; the dead rank's part is gone")
    if zero_stage in (1, 2, 3):
        what = f"ZeRO stage {zero_stage}" if host == "DeepSpeed" else f"{host}'s distributed optimizer"
        return (f"{what} shards the optimizer state across the data-parallel ranks; the dead rank's "
                f"shard is gone (checkpoint.memory_every snapshots survive a rank's death and cover "
                f"this case)")
    if has_residuals:
        return ("compression error-feedback residuals are per rank; the dead rank's are gone and a "
                "resume without them would not continue the same training")
    return None


def commit_alone(root: str, tag: str, step: int, *, world_size: int, layout: Mapping[str, Any],
                 versions: Mapping[str, str], rank: int, write: Callable[[str], None],
                 check_hash: bool = True) -> str:
    """Commit ``tag`` of ``step`` into ``root`` from this rank alone; return what happened.

    ``write(staging_dir)`` writes the host's files into the given directory. Returns a sentence
    for the log ("committed ...", "already committed ...", "rank N writes it"); raises
    :class:`CheckpointError` (after removing its staging directory) when the save failed.
    """
    store.check_tag(tag)
    final = os.path.join(root, tag)
    if os.path.exists(os.path.join(final, MANIFEST_NAME)):
        return f"{final} (step {step}) is committed already"
    os.makedirs(root, exist_ok=True)
    staging = os.path.join(root, STAGING_PREFIX + tag)
    # The election: a private directory holding the writer's rank is renamed to the common name.
    # rename() onto an existing non-empty directory fails, so exactly one rank wins, and whoever
    # loses can read the winner's rank at once.
    mine = f"{staging}.r{rank}"
    shutil.rmtree(mine, ignore_errors=True)
    os.mkdir(mine)
    with open(os.path.join(mine, ".writer"), "w") as f:
        f.write(str(rank))
    try:
        os.rename(mine, staging)
    except OSError:
        shutil.rmtree(mine, ignore_errors=True)
        return f"rank {_read_owner(staging)} writes {final} (step {step})"
    t0 = time.monotonic()
    try:
        write(staging)
        os.remove(os.path.join(staging, ".writer"))
        rels = list_files(staging)
        if not rels:
            raise OSError("the host wrote no files")
        for rel in rels:
            fsync_file(os.path.join(staging, rel))
        files = describe_files(staging, rels, check_hash)
        manifest = Manifest(tag=tag, step=int(step), sequence=store.next_sequence(root), world_size=world_size,
                            files=tuple(sorted(files, key=lambda e: e.path)), layout=dict(layout),
                            versions=dict(versions), saved_at=time.time())
        write_manifest(staging, manifest)
        for dirpath, _, _ in os.walk(staging):
            fsync_dir(dirpath)
        if os.path.exists(os.path.join(final, MANIFEST_NAME)):
            # Another rank won an earlier election and committed while this one wrote.
            shutil.rmtree(staging, ignore_errors=True)
            return f"{final} (step {step}) was committed by another rank meanwhile"
        if os.path.exists(final):
            # A directory of that name without a manifest (a partial save of another kind):
            # never replaced, so nothing a user may want to inspect is lost.
            raise OSError(f"{final} exists without a {MANIFEST_NAME}; not overwritten")
        os.rename(staging, final)
        fsync_dir(root)
        store.write_latest(root, tag)
    except Exception as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(f"emergency checkpoint {final} (step {step}) failed on rank {rank}: "
                              f"{type(exc).__name__}: {exc}; nothing was committed") from exc
    size = sum(f.size for f in manifest.files)
    return (f"committed {final} (step {step}, {len(manifest.files)} files, {size / 1e6:.1f} MB) "
            f"in {time.monotonic() - t0:.2f} s")


def _read_owner(staging: str) -> str:
    try:
        with open(os.path.join(staging, ".writer")) as f:
            return f.read().strip() or "?"
    except OSError:
        return "?"
