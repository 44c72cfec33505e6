"""A process forked after ``import wandb`` gets its own W&B media directory (patches/wandb_fork.py)."""

from __future__ import annotations

import os

import pytest


def test_a_forked_child_that_exits_keeps_its_parents_media_dir():
    pytest.importorskip("wandb")
    from wandb.sdk.data_types._private import MEDIA_TMP

    parent = MEDIA_TMP.name
    assert os.path.isdir(parent)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: what a forked standby does, then wandb's exit handler
        code = 1
        try:
            from robust_plugins.patches import wandb_fork

            own = wandb_fork.own_media_dir()
            ok = own is not None and own != parent and os.path.isdir(own)
            MEDIA_TMP.cleanup()  # registered by `import wandb`, runs at a normal exit
            code = 0 if ok and not os.path.exists(own) else 2
            os.write(w, own.encode() if own else b"")
        finally:
            os._exit(code)
    os.close(w)
    child_dir = os.read(r, 4096).decode()
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, child_dir
    assert os.path.isdir(parent), "the child's exit removed its parent's media directory"


def test_without_wandb_imported_there_is_nothing_to_do(monkeypatch):
    import sys

    from robust_plugins.patches import wandb_fork

    monkeypatch.delitem(sys.modules, wandb_fork.MODULE, raising=False)
    assert wandb_fork.own_media_dir() is None
