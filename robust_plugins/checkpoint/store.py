"""A directory of checkpoints: naming, atomic commit, ``latest``, restore choice and pruning.

Layout of a checkpoint directory ``root``::

    root/<tag>/...files...            committed: holds robust_manifest.json
    root/.tmp-<tag>/                  a save in progress (or the leftover of an interrupted one)
    root/.old-<tag>/                  a checkpoint being replaced by a save with the same tag
    root/latest                       the newest committed tag (for the host's own loader)

A save writes into ``.tmp-<tag>``, adds the manifest last, renames the directory to ``<tag>``
(one atomic ``rename``), and only then points ``latest`` at it (write a temporary file, fsync,
rename). A crash at any moment leaves either the previous state or the new one, plus at worst a
``.tmp-`` directory that loading skips and the next save removes.

The functions are pure where they can be (:func:`choose`, :func:`plan_prune` work on whatever is
on disk and return decisions); nothing here knows about DeepSpeed or torch.distributed.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from typing import Any, Mapping

from robust_plugins.checkpoint.manifest import (
    MANIFEST_NAME, Manifest, ManifestError, fsync_dir, read_manifest, verify_files,
)
from robust_plugins.errors import CheckpointError

TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"
LATEST = "latest"
_LATEST_TMP = ".latest.tmp"

#: Why a leftover temporary directory is never loaded.
LEFTOVER = "leftover temporary directory of an interrupted save (never committed)"
NO_MANIFEST = (f"no {MANIFEST_NAME}: a partial checkpoint, or one saved without the "
               f"robust_plugins checkpoint block")


def check_tag(tag: str) -> str:
    """Return ``tag`` if it can name a checkpoint directory; CheckpointError otherwise."""
    if not isinstance(tag, str) or not tag or tag in (".", "..") or "/" in tag or os.sep in tag:
        raise CheckpointError(f"Checkpoint tag {tag!r} cannot name a directory: use a non-empty name "
                              f"without '/' (e.g. 'global_step100').")
    if tag.startswith("."):
        raise CheckpointError(f"Checkpoint tag {tag!r} starts with '.', which robust_plugins reserves for "
                              f"temporary directories ({TMP_PREFIX}*, {OLD_PREFIX}*). Choose another tag.")
    if tag == LATEST:
        raise CheckpointError(f"Checkpoint tag {tag!r} would collide with the '{LATEST}' file. Choose another tag.")
    return tag


def tmp_dir(root: str, tag: str) -> str:
    """Where a save of ``tag`` is written before it is committed."""
    return os.path.join(root, TMP_PREFIX + tag)


@dataclass(frozen=True)
class Entry:
    """One directory of ``root`` that holds (or held, or was to hold) a checkpoint."""

    tag: str
    """Directory name."""

    manifest: Manifest | None = None
    """The parsed manifest; None when there is none or it is unreadable."""

    problem: str | None = None
    """Why this directory can never be loaded (leftover, no manifest, bad manifest); None if it
    has a manifest (its files still need :func:`check_entry`)."""


def _looks_like_checkpoint(path: str) -> bool:
    # Any file at all: unrelated empty folders (e.g. a tensorboard dir created early) are ignored,
    # but a half-written checkpoint may not have reached its first .pt file's final name yet.
    for _, _, files in os.walk(path):
        if files:
            return True
    return False


def scan(root: str) -> list[Entry]:
    """Every checkpoint-like directory of ``root``: first those that can never load (leftovers,
    no or bad manifest; by name), then committed ones newest first (by manifest sequence, then
    step). A missing ``root`` has none."""
    if not os.path.isdir(root):
        return []
    committed, broken = [], []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if not os.path.isdir(path) or os.path.islink(path):
            continue
        if name.startswith((TMP_PREFIX, OLD_PREFIX)):
            broken.append(Entry(name, problem=LEFTOVER))
            continue
        if not os.path.exists(os.path.join(path, MANIFEST_NAME)):
            if _looks_like_checkpoint(path):
                broken.append(Entry(name, problem=NO_MANIFEST))
            continue
        try:
            committed.append(Entry(name, manifest=read_manifest(path)))
        except (ManifestError, OSError, UnicodeDecodeError) as exc:
            broken.append(Entry(name, problem=f"{MANIFEST_NAME} is unreadable: {exc}"))
    committed.sort(key=lambda e: (e.manifest.sequence, e.manifest.step, e.tag), reverse=True)
    return broken + committed


def check_entry(root: str, entry: Entry, expect: Mapping[str, Any], check_hash: bool = True) -> str | None:
    """Why ``entry`` must not be loaded by a job described by ``expect``, or None if it may.

    ``expect`` maps ``world_size`` (the manifest's) or a key of the manifest's ``layout``
    (e.g. ``zero_stage``) to this job's value.
    """
    if entry.problem is not None:
        return entry.problem
    m = entry.manifest
    for key, want in expect.items():
        got = m.world_size if key == "world_size" else m.layout.get(key)
        if got != want:
            return (f"saved with {key}={got}, this job has {key}={want} "
                    f"(loading into another layout is not supported yet)")
    return verify_files(os.path.join(root, entry.tag), m, check_hash)


@dataclass
class Choice:
    """What :func:`choose` decided."""

    tag: str | None
    """The checkpoint to load; None if none is usable."""

    skipped: list[tuple[str, str]] = field(default_factory=list)
    """(tag, reason) for every checkpoint passed over, in the order they were considered."""

    found_any: bool = False
    """True if ``root`` held anything checkpoint-like (so None means "all unusable", not "fresh")."""


def choose(root: str, expect: Mapping[str, Any], check_hash: bool = True,
           max_step: int | None = None) -> Choice:
    """The newest committed checkpoint of ``root`` that verifies, and why others were skipped.

    Never-loadable directories are all reported; committed ones are checked newest first and
    the first intact one wins (older ones are not read). ``max_step``: newest step a rollback
    may load (:func:`robust_plugins.checkpoint.restore.rollback_bound`); newer ones are skipped.
    """
    entries = scan(root)
    choice = Choice(None, found_any=bool(entries))
    for entry in entries:
        if max_step is not None and entry.manifest is not None and entry.manifest.step > max_step:
            choice.skipped.append((entry.tag, f"step {entry.manifest.step} is after the rollback's "
                                              f"last good step {max_step}"))
            continue
        problem = check_entry(root, entry, expect, check_hash)
        if problem is None:
            choice.tag = entry.tag
            return choice
        choice.skipped.append((entry.tag, problem))
    return choice


def next_sequence(root: str) -> int:
    """Sequence number for the next commit into ``root`` (1 + the largest committed)."""
    seqs = [e.manifest.sequence for e in scan(root) if e.manifest is not None]
    return max(seqs, default=0) + 1


def publish(root: str, tag: str) -> None:
    """Rename ``.tmp-<tag>`` (manifest already inside, fsynced) to ``<tag>`` and make it durable.

    An existing ``<tag>`` is moved aside to ``.old-<tag>`` first and deleted after: a crash
    between the two renames leaves ``<tag>`` absent but both copies on disk, never a mix.
    """
    final = os.path.join(root, tag)
    old = os.path.join(root, OLD_PREFIX + tag)
    if os.path.exists(final):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp_dir(root, tag), final)
    fsync_dir(root)
    shutil.rmtree(old, ignore_errors=True)


def write_latest(root: str, tag: str) -> None:
    """Point ``root/latest`` at ``tag`` atomically (temporary file, fsync, rename, fsync dir)."""
    tmp = os.path.join(root, _LATEST_TMP)
    with open(tmp, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, LATEST))
    fsync_dir(root)


def read_latest(root: str) -> str | None:
    """The tag ``root/latest`` names, or None if there is no such file."""
    try:
        with open(os.path.join(root, LATEST)) as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


def plan_prune(newest_first: list[tuple[str, bool]], keep: int) -> list[str]:
    """Tags to delete so that the ``keep`` newest intact checkpoints remain.

    ``newest_first`` lists committed checkpoints as (tag, intact). Broken ones do not count
    towards ``keep``; those newer than the oldest kept intact one are left for inspection,
    everything older than it goes.
    """
    if keep < 1:
        raise ValueError(f"keep = {keep} must be >= 1")
    kept, delete = 0, []
    for tag, intact in newest_first:
        if kept >= keep:
            delete.append(tag)
        elif intact:
            kept += 1
    return delete


def prune(root: str, keep: int, in_progress: str | None = None) -> list[str]:
    """Delete committed checkpoints beyond ``keep`` and leftover temporary directories.

    Intact here means manifest present and every file at its recorded size (hashing every kept
    checkpoint at every save would cost reading them all). Directories without a manifest are
    not ours and are never deleted. Returns the deleted directory names.
    """
    entries = scan(root)
    committed = [(e.tag, check_entry(root, e, {}, check_hash=False) is None)
                 for e in entries if e.manifest is not None]
    doomed = plan_prune(committed, keep)
    doomed += [e.tag for e in entries if e.problem == LEFTOVER and e.tag != in_progress]
    for name in doomed:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return doomed
