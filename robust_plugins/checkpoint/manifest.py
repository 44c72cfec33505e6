"""The manifest of one committed checkpoint: every file's size and sha256, and the job's layout.

A checkpoint directory is trusted only if ``robust_manifest.json`` is present, parses, lists
every file in the directory (nothing more, nothing less) and every file has the recorded size
and, when hashed, the recorded sha256. :func:`verify_dir` returns the first problem found as a
sentence for the log, or ``None``. Nothing here knows about DeepSpeed or torch.distributed.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping

#: File name of the manifest inside a checkpoint (tag) directory.
MANIFEST_NAME = "robust_manifest.json"

#: Bumped when the manifest layout changes incompatibly.
FORMAT = 1

#: Read size when hashing: 1 MiB keeps Python overhead negligible against sha256 itself.
_CHUNK = 1 << 20


class ManifestError(ValueError):
    """A manifest file cannot be read or does not have the expected fields."""


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint, by path relative to the tag directory."""

    path: str
    """Relative path with ``/`` separators (``mp_rank_00_model_states.pt``)."""

    size: int
    """Size in bytes."""

    sha256: str | None
    """Hex digest, or ``None`` when the checkpoint was saved with ``verify: none``."""


@dataclass(frozen=True)
class Manifest:
    """What :func:`write_manifest` stores and :func:`read_manifest` returns."""

    tag: str
    """The checkpoint's tag (the directory's final name)."""

    step: int
    """Optimizer step at which the checkpoint was taken."""

    sequence: int
    """1 + the largest sequence of the checkpoints already in the directory when this one was
    committed: orders checkpoints by commit, independent of clocks and of step numbers (a run
    rolled back to an older step commits a newer checkpoint with a smaller step)."""

    world_size: int
    """Number of ranks that wrote the checkpoint."""

    files: tuple[FileEntry, ...]
    """Every file in the directory except the manifest itself."""

    layout: Mapping[str, Any] = field(default_factory=dict)
    """Host settings a loader must match (e.g. ``{"zero_stage": 2, "dp_world_size": 2}``)."""

    versions: Mapping[str, str] = field(default_factory=dict)
    """Library versions at save time (``deepspeed``, ``torch``), for diagnostics only."""

    saved_at: float = 0.0
    """Unix time of the commit on the writing rank 0 (diagnostics only, never used to order)."""

    def to_json(self) -> str:
        """The manifest as indented JSON text."""
        d = asdict(self)
        d["format"] = FORMAT
        d["files"] = [asdict(f) for f in self.files]
        return json.dumps(d, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        """Parse and type-check manifest text; raises ManifestError naming the bad field."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ManifestError(f"not valid JSON ({exc.msg} at line {exc.lineno})") from None
        if not isinstance(d, dict):
            raise ManifestError(f"top level is {type(d).__name__}, not an object")
        if d.get("format") != FORMAT:
            raise ManifestError(f"format {d.get('format')!r}, this version reads format {FORMAT}")

        def get(key: str, types: tuple[type, ...]) -> Any:
            value = d.get(key)
            if isinstance(value, bool) or not isinstance(value, types):
                raise ManifestError(f"field {key!r} is {value!r}, expected {types[0].__name__}")
            return value

        files = []
        for i, f in enumerate(get("files", (list,))):
            ok = (isinstance(f, dict) and isinstance(f.get("path"), str) and isinstance(f.get("size"), int)
                  and not isinstance(f.get("size"), bool) and f["size"] >= 0
                  and (f.get("sha256") is None or isinstance(f.get("sha256"), str)))
            if not ok:
                raise ManifestError(f"files[{i}] = {f!r} is not {{path, size, sha256}}")
            files.append(FileEntry(f["path"], f["size"], f.get("sha256")))
        return cls(
            tag=get("tag", (str,)), step=get("step", (int,)), sequence=get("sequence", (int,)),
            world_size=get("world_size", (int,)), files=tuple(files),
            layout=get("layout", (dict,)), versions=get("versions", (dict,)),
            saved_at=float(get("saved_at", (int, float))),
        )


def hash_file(path: str | os.PathLike, with_sha: bool = True) -> tuple[int, str | None]:
    """(size, sha256 hex or None) of a file, read in 1 MiB chunks."""
    if not with_sha:
        return os.stat(path).st_size, None
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def list_files(root: str | os.PathLike) -> list[str]:
    """Every regular file under ``root`` except the manifest, as sorted ``/``-separated paths."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in filenames:
            rel = os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/")
            if rel != MANIFEST_NAME:
                out.append(rel)
    return sorted(out)


def describe_files(root: str | os.PathLike, relpaths: Iterable[str], with_sha: bool = True) -> list[FileEntry]:
    """FileEntry for each relative path under ``root``."""
    return [FileEntry(rel, *hash_file(os.path.join(root, rel), with_sha)) for rel in relpaths]


def fsync_file(path: str | os.PathLike) -> None:
    """Flush one file's data to stable storage (opened read-only: works for files others wrote)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a directory's entries (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(root: str | os.PathLike, manifest: Manifest) -> None:
    """Write the manifest into ``root`` and fsync it (``root`` is not yet published)."""
    path = os.path.join(root, MANIFEST_NAME)
    with open(path, "w") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())


def read_manifest(root: str | os.PathLike) -> Manifest:
    """Read ``root``'s manifest; FileNotFoundError if absent, ManifestError if malformed."""
    with open(os.path.join(root, MANIFEST_NAME)) as f:
        text = f.read()
    return Manifest.from_json(text)


def verify_files(root: str | os.PathLike, manifest: Manifest, check_hash: bool = True) -> str | None:
    """First problem with ``root``'s files against ``manifest`` as a sentence, or None if intact.

    Checks that the set of files equals the manifest's (an unlisted file could be picked up by a
    host that globs for shards), then sizes (cheap: catches truncation), then, with
    ``check_hash``, every sha256 recorded.
    """
    listed = {f.path: f for f in manifest.files}
    present = list_files(root)
    for rel in present:
        if rel not in listed:
            return f"file {rel} is not listed in the manifest"
    for entry in manifest.files:
        path = os.path.join(root, entry.path)
        if not os.path.isfile(path):
            return f"file {entry.path} listed in the manifest is missing"
        size = os.stat(path).st_size
        if size != entry.size:
            kind = "truncated" if size < entry.size else "grown"
            return f"file {entry.path} is {size} bytes, the manifest says {entry.size} ({kind})"
    if check_hash:
        for entry in manifest.files:
            if entry.sha256 is None:
                continue
            _, sha = hash_file(os.path.join(root, entry.path))
            if sha != entry.sha256:
                return (f"file {entry.path} has sha256 {sha[:12]}..., the manifest says "
                        f"{entry.sha256[:12]}... (corrupted)")
    return None
