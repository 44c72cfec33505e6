"""The ``checkpoint`` sub-block: verified, atomic disk checkpoints and in-memory snapshots."""

import os
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from robust_plugins.errors import ConfigError
from robust_plugins.schema._base import Hint, Section
from robust_plugins.schema.common import BLOCK_KEY, MEMORY_COPY_MODES, VERIFY_MODES

#: Optimizer steps between automatic saves, or null (off).
_Every = Annotated[int | None, Field(ge=1), Hint(expect="an integer number of steps or null",
                                                  why="(or null to turn it off)")]


def path_string(value: Any, what: str) -> Any:
    """An ``os.PathLike`` as its string; ``''`` refused (``what``: "a directory path")."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if value == "":
        raise ValueError(f"is empty: give {what} or leave it out")
    return value


class CheckpointConfig(Section):
    """Verified, atomic disk checkpoints (``"checkpoint"`` sub-block).

    With this sub-block, DeepSpeed's ``save_checkpoint`` writes into a temporary directory,
    records every file's size and sha256 in a manifest, and renames the directory into place;
    ``latest`` is updated only afterwards. ``load_checkpoint`` without a tag loads the newest
    checkpoint whose manifest verifies and skips (with one log line each) corrupt, truncated,
    partial or mismatched ones.
    """

    where: ClassVar[str] = f"{BLOCK_KEY}.checkpoint"

    dir: Annotated[str | None, Hint(expect="a directory path (string)")] = None
    """Checkpoint directory used when ``save_checkpoint`` / ``load_checkpoint`` are called
    without one (``None``: the caller always passes it). Required by ``persist_every``."""

    persist_every: _Every = None
    """Save a disk checkpoint into ``dir`` automatically after every this many optimizer steps
    (``None``: only when the training script calls ``save_checkpoint``). Synchronous, unless
    ``memory_every`` is set too: then the snapshot thread writes it in the background from the
    committed in-memory snapshot (``robust_plugins.checkpoint.persist``)."""

    keep: Annotated[int, Field(ge=1), Hint(why="the newest checkpoint is always kept")] = 3
    """Committed checkpoints kept in a directory: after each save, older ones beyond the ``keep``
    newest intact ones are deleted (directories without a robust_plugins manifest are never
    touched)."""

    verify: Literal[VERIFY_MODES] = "sha256"
    """``sha256``: hash every file on save and check every hash before loading. ``none``: check
    only that every file is present with its recorded size (cheaper for very large checkpoints,
    but a flipped bit is not caught)."""

    memory_every: _Every = None
    """Snapshot the whole training state into shared memory (``/dev/shm``, double-buffered,
    survives the death of the process) every this many optimizer steps; ``load_checkpoint``
    restores from it first. Needs a job id stable across restarts (``robust run`` or
    ``ROBUST_JOB_ID``). ``None``: off."""

    peer_backup: bool = False
    """With ``memory_every``: also copy each rank's snapshot into the shared memory of a rank on
    another node (outside its model-parallel groups when the layout allows), so a restart after
    losing a whole node restores from the peers (at most two steps back). Shared memory: three
    own snapshots and three of a peer's a rank, instead of two."""

    verify_replicas: bool = True
    """With ``memory_every``, under ``robust run`` (unless its watchdog's ``sdc_every_steps`` is 0):
    once each snapshot is committed, the snapshot thread hashes the parameters' bytes in it and
    agrees on the hash with the other data-parallel replicas (16 bytes on a gloo group of its
    own; the training loop does not wait for it). A mismatch is silent data corruption: that
    snapshot is uncommitted on every rank, no later one is taken, and ``robust run`` rolls back to
    the one before it, from memory (one step lost with ``memory_every: 1``), naming the ranks that
    differ. ``false``: off (the SDC check is then ``watchdog.check_params`` alone). No effect
    outside ``robust run``, or where a rank has no replica (said on rank 0). DeepSpeed ZeRO-3 has
    none (every rank holds other partitions): ``true`` written there is refused."""

    memory_copy: Literal[MEMORY_COPY_MODES] = "background"
    """With ``memory_every``: ``background`` copies parameters and optimizer state (which only the
    optimizer step changes) on the snapshot thread while the next forward and backward run; the
    next optimizer step (and any load) first waits until the snapshot is committed, and a tensor
    changed in place meanwhile fails the snapshot loudly. ``in_step`` copies everything inside
    the step (for loops that change parameters outside the optimizer step)."""

    timeout_s: Annotated[float, Field(gt=0, allow_inf_nan=False), Hint(why="(seconds)")] = 900.0
    """Bound on every wait for the other ranks during a save or load (gathering file hashes,
    agreeing on the tag to load). A rank that does not answer in time fails the save / load with
    CheckpointError instead of hanging."""

    resume: Annotated[bool | None, Hint(expect="true or false (or null: on under robust run)")] = None
    """Load the newest checkpoint that verifies from ``dir`` inside ``deepspeed.initialize`` (own
    memory snapshot, a peer's copy, disk, in that order, as ``engine.load_checkpoint(dir)``), so an
    unchanged script restarted by ``robust run`` continues at ``engine.global_steps + 1``. A
    fresh start (nothing in ``dir``) is logged and trains from step 1. ``true`` needs ``dir``.
    ``None`` (unset): on under ``robust run`` (from memory alone without ``dir``), off outside
    it. ``false``: never (the script loads itself, or starts cold)."""

    emergency_save: bool = True
    """Under ``robust run``: when a peer rank dies, the live ranks' failing collective writes a
    verified checkpoint of the last completed step into ``dir`` without any collective
    (``robust_plugins.watchdog.on_emergency``; one rank writes, the others see it and stop).
    Possible only where one rank holds the whole state: DeepSpeed ZeRO 0 without compression
    residuals; ZeRO 1/2 shard the optimizer state, so the dead rank's shard is gone and the save
    is skipped, with the reason in ``faults.jsonl``. No effect without ``dir``, with
    ``memory_every`` (its snapshots outlive the dead rank and restore every stage) or outside
    ``robust run``."""

    @field_validator("dir", mode="before")
    @classmethod
    def _dir(cls, value: Any) -> Any:
        return path_string(value, "a directory path")

    @model_validator(mode="after")
    def _cross_checks(self) -> "CheckpointConfig":
        where = self.where
        if self.persist_every is not None and self.dir is None:
            raise ConfigError(
                f"{where}.persist_every = {self.persist_every} needs {where}.dir: automatic saves "
                f"have no directory to go to. Set dir or remove persist_every."
            )
        if self.resume and self.dir is None:
            raise ConfigError(
                f"{where}.resume = true needs {where}.dir: there is no directory to resume from. "
                f"Set dir or remove resume."
            )
        if self.peer_backup and self.memory_every is None:
            raise ConfigError(
                f"{where}.peer_backup = true needs {where}.memory_every: peers back up in-memory "
                f"snapshots. Set memory_every (e.g. 1) or remove peer_backup."
            )
        return self

    def describe(self) -> str:
        """One-line summary for logs and ``robust check-config``."""
        every = f"every {self.persist_every} steps" if self.persist_every else "on save_checkpoint"
        mem = (f", memory every {self.memory_every} steps{' + peer backup' if self.peer_backup else ''}"
               if self.memory_every else "")
        return (
            f"checkpoint(dir={self.dir}, persist {every}{mem}, keep={self.keep}, verify={self.verify}, "
            f"timeout_s={self.timeout_s:g}{', resume' if self.resume else ''})"
        )
