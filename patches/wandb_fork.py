"""W&B in a process forked after ``import wandb`` (warm standbys, fork servers).

``import wandb`` creates one staging directory for media and tables
(``wandb.sdk.data_types._private.MEDIA_TMP``) and removes it at the interpreter's exit. A process
forked from one that had imported wandb (a ``robust run`` standby forked from its node's zygote)
inherits both the directory's name and that clean-up: the first forked rank to exit normally
removes the directory its siblings and every later rank of that zygote still use, and their next
table or image logged to W&B fails (``FileNotFoundError`` inside ``wandb.log``).
:func:`own_media_dir`, called in the forked child, gives it a staging directory of its own, which
its exit removes; the parent's stays.
"""

from __future__ import annotations

import sys
import tempfile

from robust_plugins._logging import get_logger

log = get_logger(__name__)

#: wandb's module that holds the staging directory (wandb 0.1x-0.2x).
MODULE = "wandb.sdk.data_types._private"


def own_media_dir() -> str | None:
    """Point wandb's media staging directory at a new one of this process; its path, or None when
    wandb was not imported before the fork (a later import makes its own)."""
    mod = sys.modules.get(MODULE)
    if mod is None:
        return None
    tmp = getattr(mod, "MEDIA_TMP", None)
    if not isinstance(tmp, tempfile.TemporaryDirectory):
        log.warning("robust_plugins: wandb's %s.MEDIA_TMP is not a TemporaryDirectory in this wandb: a "
                    "forked rank may share (and remove) its parent's media directory; W&B tables and "
                    "images may then fail to log.", MODULE)
        return None
    # wandb's exit handler calls tmp.cleanup(), which detaches the inherited finalizer and removes
    # tmp.name: from now on this process's own directory, never the parent's.
    tmp.name = tempfile.mkdtemp(suffix="wandb-media")
    return tmp.name
