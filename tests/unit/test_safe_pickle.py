"""A megatron-core / torch.distributed.checkpoint directory is checked before megatron reads it
(``robust_plugins.checkpoint.safe_pickle``): torch unpickles ``.metadata`` with plain pickle.load.

Each hostile file creates a marker file when plainly unpickled (``open(marker, "w")``); the check
must refuse it naming the global, and the marker must not exist afterwards.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from robust_plugins.checkpoint.safe_pickle import check_dist_checkpoint
from robust_plugins.errors import CheckpointError


class _Hostile:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture
def saved(tmp_path):
    """A real torch.distributed.checkpoint directory (one process), plus a megatron-style common.pt."""
    d = tmp_path / "iter_0000001"
    dcp.save({"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2, dtype=torch.bfloat16), "note": b"x"},
             storage_writer=dcp.FileSystemWriter(str(d)), no_dist=True)
    torch.save({"step": 1, "args": {"lr": 1e-3}}, d / "common.pt")
    return d


def test_a_real_checkpoint_passes(saved):
    check_dist_checkpoint(saved)
    assert (saved / ".metadata").is_file()


def test_hostile_metadata_is_refused_before_anything_runs(saved, tmp_path):
    marker = tmp_path / "marker"
    with open(saved / ".metadata", "rb") as f:
        meta = pickle.load(f)  # the genuine object, re-saved with a payload beside it
    (saved / ".metadata").write_bytes(pickle.dumps((meta, _Hostile(marker))))
    with pytest.raises(CheckpointError, match=r"\.metadata holds more than torch's checkpoint metadata "
                                              r"\(global \S*open is not allowed\)"):
        check_dist_checkpoint(saved)
    assert not marker.exists()
    pickle.loads((saved / ".metadata").read_bytes())  # the control: plain pickle would have run it
    assert marker.exists()


def test_hostile_common_pt_is_refused_naming_the_global(saved, tmp_path):
    marker = tmp_path / "marker"
    torch.save({"step": 1, "payload": _Hostile(marker)}, saved / "common.pt")
    with pytest.raises(CheckpointError, match=r"common\.pt needs the global \S*open to load"):
        check_dist_checkpoint(saved)
    assert not marker.exists()
