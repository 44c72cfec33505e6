"""Verified, atomic disk checkpoints, independent of the training framework.

* :mod:`~robust_plugins.checkpoint.manifest`: the per-checkpoint manifest (every file's size and
  sha256, world size, layout) and verification of a directory against it.
* :mod:`~robust_plugins.checkpoint.store`: directory layout, atomic publish and ``latest``,
  choosing what to restore, pruning to ``keep``.
* :mod:`~robust_plugins.checkpoint.coord`: bounded agreement between ranks (JSON, no pickles).
* :mod:`~robust_plugins.checkpoint.disk`: the save / restore protocol a host integration drives
  (``patches/deepspeed.py`` for DeepSpeed).
"""

from robust_plugins.checkpoint.disk import DiskCheckpointer
from robust_plugins.checkpoint.manifest import MANIFEST_NAME, FileEntry, Manifest, verify_files
from robust_plugins.checkpoint.store import choose, plan_prune, scan

__all__ = ["DiskCheckpointer", "FileEntry", "MANIFEST_NAME", "Manifest", "choose", "plan_prune", "scan",
           "verify_files"]
