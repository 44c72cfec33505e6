"""A byte-level text corpus made of the Python standard library's own ``.py`` files.

Why the stdlib: it is on every machine that can run this package, it is real code with long-range
structure a small GPT can learn, and reading it needs no network. The corpus depends on the
interpreter's version, so results record :attr:`TextCorpus.sha256` to make comparisons honest.

Determinism contract: :func:`get_batch` is a pure function of
``(split, seed, step, rank, world_size, micro_batch, seq_len)``. A run resumed at step ``k`` therefore
sees exactly the batches an uninterrupted run sees from step ``k`` on.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from robust_plugins.errors import ConfigError

#: Directory names never read: installed third-party code (differs between machines) and the
#: stdlib's own test suites (huge, full of deliberately odd bytes).
SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "_bundled"}
)

#: Default cap on the corpus. 4 MiB is ~1/3 of CPython 3.11's stdlib; far more bytes than a demo
#: run consumes (150 steps x 4 ranks x 8 x 128 = 0.6 MB), and it reads in ~50 ms.
DEFAULT_MAX_BYTES = 4 * 2**20

#: Fraction of the byte stream (its tail) held out for validation.
DEFAULT_VAL_FRACTION = 0.05

SPLITS = ("train", "val")


def stdlib_dir() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_source_files(root: Path) -> list[Path]:
    """All ``.py`` files under ``root`` in a stable order (sorted walk), skipping :data:`SKIP_DIRS`."""
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Sorting in place also fixes the order os.walk descends in.
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return files


@dataclass(frozen=True, eq=False)
class TextCorpus:
    """The corpus as two uint8 arrays: ``train`` (the head) and ``val`` (the tail)."""

    train: np.ndarray
    """Training bytes, the first ``1 - val_fraction`` of the stream."""

    val: np.ndarray
    """Validation bytes, the last ``val_fraction`` of the stream; never overlaps ``train``."""

    sha256: str
    """Hash of the whole byte stream, recorded in results so runs on different Pythons differ loudly."""

    n_files: int
    """Number of source files read."""

    def split(self, name: str) -> np.ndarray:
        """The array for ``"train"`` or ``"val"``."""
        if name == "train":
            return self.train
        if name == "val":
            return self.val
        raise ConfigError(f"Unknown split {name!r}; expected one of {', '.join(SPLITS)}.")


@functools.lru_cache(maxsize=4)
def load_corpus(
    max_bytes: int = DEFAULT_MAX_BYTES,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    root: str | None = None,
) -> TextCorpus:
    """Read the stdlib sources (sorted paths) into one byte stream, capped at ``max_bytes``.

    Files are joined whole, in order, until the cap; the last one is cut at the cap. The result is
    cached per process, so every run in a multi-run launch shares one copy.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"val_fraction = {val_fraction} must be strictly between 0 and 1 (e.g. 0.05).")
    base = Path(root) if root is not None else stdlib_dir()
    files = list_source_files(base)
    if not files:
        raise ConfigError(f"No .py files found under {base}; cannot build the text corpus.")
    chunks: list[bytes] = []
    total = 0
    used = 0
    for path in files:
        if total >= max_bytes:
            break
        data = path.read_bytes() + b"\n"
        chunks.append(data[: max_bytes - total])
        total += len(chunks[-1])
        used += 1
    stream = b"".join(chunks)
    n_val = int(len(stream) * val_fraction)
    arr = np.frombuffer(stream, dtype=np.uint8)
    return TextCorpus(
        train=arr[: len(arr) - n_val],
        val=arr[len(arr) - n_val :],
        sha256=hashlib.sha256(stream).hexdigest(),
        n_files=used,
    )


# Distinct streams for the two splits: validation batch i must not equal training batch i.
_SPLIT_STREAM = {"train": 0, "val": 1}


def get_batch(
    corpus: TextCorpus,
    split: str,
    *,
    seed: int,
    step: int,
    rank: int,
    world_size: int,
    micro_batch: int,
    seq_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(inputs, targets)``, int64 tensors of shape ``[micro_batch, seq_len]``.

    The global batch of a step (``world_size * micro_batch`` windows) is drawn from a generator
    seeded with ``(seed, split, step)`` only; each rank takes its contiguous slice. Targets are the
    inputs shifted by one byte.
    """
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is outside [0, world_size={world_size}).")
    if micro_batch < 1 or seq_len < 1 or step < 0:
        raise ConfigError(
            f"micro_batch ({micro_batch}) and seq_len ({seq_len}) must be >= 1 and step ({step}) >= 0."
        )
    data = corpus.split(split)
    n_starts = len(data) - seq_len - 1
    if n_starts <= 0:
        raise ConfigError(
            f"The {split} split has {len(data)} bytes, too few for seq_len {seq_len}; "
            f"raise max_bytes or lower seq_len."
        )
    rng = np.random.Generator(np.random.PCG64([seed, _SPLIT_STREAM[split], step]))
    starts = rng.integers(0, n_starts, size=world_size * micro_batch)
    mine = starts[rank * micro_batch : (rank + 1) * micro_batch]
    windows = data[mine[:, None] + np.arange(seq_len + 1)].astype(np.int64)
    tokens = torch.from_numpy(windows)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
