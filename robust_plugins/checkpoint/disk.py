"""The save and restore protocol for verified, atomic disk checkpoints, for any host.

A host integration (``patches/deepspeed.py``) drives one save as::

    ckpt.begin(root, tag)                 # all ranks: rank 0 clears a stale .tmp-<tag>; barrier
    ...the host writes its files into ckpt.staging(root, tag), calling
       ckpt.record(path) after each file it wrote, ckpt.fail(exc) if a write failed...
    ckpt.finish(root, tag, step)          # all ranks: gather, manifest, rename, latest, prune

and one restore as ``tag = ckpt.select(root, tag)`` followed by the host's own load of that tag.

Each rank fsyncs and hashes the files it wrote itself (hashing runs in parallel, one shard a
rank); rank 0 hashes whatever else is in the directory (the host's helper scripts), writes the
manifest and commits. A failure on any rank is gathered, the temporary directory removed, and
every rank raises the same :class:`CheckpointError`; ``latest`` is untouched. Every wait for
other ranks is bounded by ``config.timeout_s``.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any, Mapping

from robust_plugins._logging import get_logger
from robust_plugins.checkpoint import coord, store
from robust_plugins.checkpoint.manifest import (
    FileEntry, Manifest, describe_files, fsync_dir, fsync_file, hash_file, list_files, write_manifest,
)
from robust_plugins.config import CheckpointConfig
from robust_plugins.errors import CheckpointError

log = get_logger(__name__)


class DiskCheckpointer:
    """Per-process driver of the protocol above for one training job."""

    def __init__(self, config: CheckpointConfig, rank: int, world_size: int,
                 layout: Mapping[str, Any] | None = None, versions: Mapping[str, str] | None = None,
                 device: Any = None, group: Any = None) -> None:
        self.config = config
        self.group = group
        """Process group of the save/load agreement (None: the default group). A save from a
        background thread uses its own group, so it never interleaves with training's collectives."""
        self.rank = rank
        self.world_size = world_size
        self.layout = dict(layout or {})
        """Host settings recorded in each manifest and required to match on load."""
        self.versions = dict(versions or {})
        self.reshardable: tuple[str, ...] = ()
        """``world_size`` / layout keys a loader may differ in (recorded, not required to match):
        the host reshards (``checkpoint.elastic``) or refuses after :meth:`select`."""
        self.device = device
        """Device of the agreement's tensors; None: what ``group``'s backend moves (CUDA on NCCL,
        CPU on gloo; :func:`robust_plugins.device.collective_device`, looked up at each call)."""
        self._written: list[str] = []
        self._error: str | None = None
        self._staging: str | None = None
        self.last_save: dict[str, float] = {}
        """Timings of the last save on this rank: ``hash_s`` (own files), ``commit_s`` (rank 0)."""

    @property
    def check_hash(self) -> bool:
        """Whether saves hash files and loads check the hashes."""
        return self.config.verify == "sha256"

    @property
    def failed(self) -> bool:
        """True once a write of the current save failed on this rank."""
        return self._error is not None

    def staging(self, root: str, tag: str) -> str:
        """The temporary directory the host writes ``tag``'s files into."""
        return store.tmp_dir(root, tag)

    # ----------------------------------------------------------------------------------- save
    def begin(self, root: str, tag: str) -> str:
        """Start a save on every rank; returns the staging directory (created, empty)."""
        store.check_tag(tag)
        staging = self.staging(root, tag)
        self._written, self._error, self._staging = [], None, staging
        setup_error = None
        if self.rank == 0:
            try:
                os.makedirs(root, exist_ok=True)
                shutil.rmtree(staging, ignore_errors=True)  # a stale leftover of the same tag
                os.makedirs(staging)
            except OSError as exc:
                setup_error = f"rank 0 cannot create {staging}: {exc}"
        outcome = coord.broadcast_json(setup_error, self.config.timeout_s,
                                       f"checkpoint {tag}: creating {staging}", device=self.device, group=self.group)
        if outcome is not None:
            raise CheckpointError(f"Checkpoint save of {tag!r} into {root} failed: {outcome}. Nothing was "
                                  f"written; check that the directory is writable.")
        return staging

    def record(self, path: str) -> None:
        """Note a file this rank wrote into the staging directory: fsync it now."""
        fsync_file(path)
        self._written.append(path)

    def fail(self, exc: BaseException, path: str | None = None) -> None:
        """Note that a write on this rank failed (the first failure is reported); drop the partial file."""
        if self._error is None:
            self._error = f"{type(exc).__name__}: {exc}"
        if path is not None:
            try:
                os.remove(path)
            except OSError:
                pass

    def finish(self, root: str, tag: str, step: int, save_latest: bool = True) -> Manifest:
        """Commit the save on every rank, or clean up and raise CheckpointError on every rank."""
        staging = self.staging(root, tag)
        t0 = time.perf_counter()
        entries: list[dict] = []
        if self._error is None:
            try:
                for path in self._written:
                    rel = os.path.relpath(path, staging).replace(os.sep, "/")
                    size, sha = hash_file(path, self.check_hash)
                    entries.append({"path": rel, "size": size, "sha256": sha})
            except OSError as exc:
                self.fail(exc)
        self.last_save = {"hash_s": time.perf_counter() - t0}
        reports = coord.all_gather_json({"error": self._error, "files": entries}, self.config.timeout_s,
                                        f"checkpoint {tag}: gathering file hashes", device=self.device,
                                        group=self.group)
        outcome: dict[str, Any] = {}
        if self.rank == 0:
            t1 = time.perf_counter()
            outcome = self._commit(root, tag, step, save_latest, reports)
            self.last_save["commit_s"] = time.perf_counter() - t1
        outcome = coord.broadcast_json(outcome, self.config.timeout_s,
                                       f"checkpoint {tag}: waiting for rank 0's commit", device=self.device,
                                       group=self.group)
        self._staging = None
        if outcome.get("error"):
            raise CheckpointError(outcome["error"])
        return Manifest.from_json(outcome["manifest"])

    def _commit(self, root: str, tag: str, step: int, save_latest: bool, reports: list[dict]) -> dict:
        staging = self.staging(root, tag)
        failures = [(r, rep["error"]) for r, rep in enumerate(reports) if rep["error"]]
        if failures:
            return self._abort(root, tag, staging, "; ".join(f"rank {r}: {e}" for r, e in failures))
        try:
            reported = {f["path"]: FileEntry(f["path"], f["size"], f["sha256"]) for rep in reports
                        for f in rep["files"]}
            rest = [rel for rel in list_files(staging) if rel not in reported]
            for rel in rest:
                fsync_file(os.path.join(staging, rel))
            files = dict(reported)
            files.update({e.path: e for e in describe_files(staging, rest, self.check_hash)})
            for entry in reported.values():
                on_disk = os.path.getsize(os.path.join(staging, entry.path))
                if on_disk != entry.size:
                    raise OSError(f"{entry.path} changed size after its rank hashed it "
                                  f"({entry.size} -> {on_disk} bytes)")
            manifest = Manifest(tag=tag, step=step, sequence=store.next_sequence(root),
                                world_size=self.world_size, files=tuple(files[k] for k in sorted(files)),
                                layout=self.layout, versions=self.versions, saved_at=time.time())
            write_manifest(staging, manifest)
            for dirpath, _, _ in os.walk(staging):
                fsync_dir(dirpath)
            store.publish(root, tag)
        except OSError as exc:
            return self._abort(root, tag, staging, f"rank 0: {type(exc).__name__}: {exc}")
        # Committed: from here on a failure does not lose the checkpoint, it only leaves
        # `latest` (read by the host's own loader, not by select()) or old checkpoints behind.
        try:
            if save_latest:
                store.write_latest(root, tag)
            pruned = store.prune(root, self.config.keep)
        except OSError as exc:
            log.warning("robust_plugins: checkpoint %s committed, but updating latest / pruning in %s "
                        "failed: %s", tag, root, exc)
            pruned = []
        size = sum(f.size for f in manifest.files)
        log.info("robust_plugins: committed checkpoint %s/%s (%d files, %.1f MB, step %d%s)%s", root, tag,
                 len(manifest.files), size / 1e6, step, ", sha256" if self.check_hash else "",
                 f"; pruned {', '.join(pruned)}" if pruned else "")
        return {"manifest": manifest.to_json()}

    def _abort(self, root: str, tag: str, staging: str, why: str) -> dict:
        shutil.rmtree(staging, ignore_errors=True)
        latest = store.read_latest(root)
        msg = (f"Checkpoint save of {tag!r} into {root} failed and was not committed ({why}). The "
               f"temporary directory was removed; 'latest' still names "
               f"{latest!r}. Free space or fix the error, then save again.")
        log.error("robust_plugins: %s", msg)
        return {"error": msg}

    # -------------------------------------------------------------------------------- restore
    def expect(self) -> dict[str, Any]:
        """What a checkpoint's manifest must match to be loaded by this job."""
        want = {"world_size": self.world_size, **self.layout}
        return {k: v for k, v in want.items() if k not in self.reshardable}

    def select(self, root: str, tag: str | None = None, max_step: int | None = None) -> str | None:
        """The tag every rank loads: ``tag`` after verifying it, or the newest intact checkpoint.

        Rank 0 decides and broadcasts. Returns None when ``root`` holds nothing checkpoint-like
        (a fresh start). Raises CheckpointError when checkpoints exist but none is usable, or when
        the requested ``tag`` fails verification (naming the file and the mismatch). ``max_step``
        (newest only): checkpoints of later steps are passed over (a rollback's bad steps).
        """
        decision: dict[str, Any] = {}
        if self.rank == 0:
            decision = self._decide(root, tag, max_step)
        decision = coord.broadcast_json(decision, self.config.timeout_s,
                                        f"checkpoint load from {root}: agreeing on the tag", device=self.device,
                                        group=self.group)
        if decision.get("error"):
            raise CheckpointError(decision["error"])
        return decision.get("tag")

    def _decide(self, root: str, tag: str | None, max_step: int | None = None) -> dict[str, Any]:
        if tag is not None:
            entry = next((e for e in store.scan(root) if e.tag == str(tag)), None)
            if entry is None:
                return {"error": f"Checkpoint {os.path.join(root, str(tag))} does not exist or holds no files."}
            problem = store.check_entry(root, entry, self.expect(), self.check_hash)
            if problem is not None:
                return {"error": f"Checkpoint {os.path.join(root, str(tag))} failed verification: {problem}. "
                                 f"It was not loaded. Load another tag, or pass tag=None to load the newest "
                                 f"intact checkpoint."}
            return {"tag": str(tag)}
        choice = store.choose(root, self.expect(), self.check_hash, max_step=max_step)
        for skipped, why in choice.skipped:
            log.warning("robust_plugins: skipped checkpoint %s: %s", os.path.join(root, skipped), why)
        if choice.tag is not None:
            log.info("robust_plugins: loading checkpoint %s (newest intact, verify=%s)",
                     os.path.join(root, choice.tag), self.config.verify)
            return {"tag": choice.tag}
        if choice.found_any:
            return {"error": f"No usable checkpoint in {root}: all {len(choice.skipped)} found were skipped "
                             f"({'; '.join(f'{t}: {w}' for t, w in choice.skipped)}). Nothing was loaded. "
                             f"Restore a good copy, or start fresh in an empty directory."}
        log.info("robust_plugins: no checkpoint in %s: starting from scratch", root)
        return {}
