"""Loads that run no code from checkpoint files (``patches/deepspeed_universal.py``, issue 4 item 5).

Each hostile file here, when unpickled by plain ``torch.load(weights_only=False)``, would create a
marker file (``open(marker, "w")``); the tests assert the load is refused naming the global, and
that the marker does not exist afterwards.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("deepspeed")

from robust_plugins.errors import CheckpointError  # noqa: E402
from robust_plugins.patches import deepspeed_universal as du  # noqa: E402


class _Hostile:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _hostile_file(path, marker) -> str:
    torch.save({"weights": torch.ones(3), "payload": _Hostile(str(marker))}, path)
    return str(path)


def test_the_hostile_file_would_run_code_without_weights_only(tmp_path):
    """The control: the payload is live, so the refusals below are what keeps it from running."""
    path = _hostile_file(tmp_path / "x.pt", tmp_path / "marker")
    torch.load(path, weights_only=False)
    assert (tmp_path / "marker").exists()


def test_safe_load_refuses_a_file_holding_code_and_names_the_global(tmp_path):
    path = _hostile_file(tmp_path / "x.pt", tmp_path / "marker")
    with pytest.raises(CheckpointError, match=r"x\.pt needs the global \S*open to load.*weights_only=True"):
        du.safe_load(path, weights_only=False)  # a caller's weights_only=False is overridden
    assert not (tmp_path / "marker").exists()


def test_safe_load_reads_the_deepspeed_types_of_the_allowlist(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    sd = {"frag": fragment_address(numel=5, start=2), "stage": ZeroStageEnum.gradients,
          "scaler": DynamicLossScaler(init_scale=2.0**8, scale_window=10, min_scale=1, delayed_shift=2,
                                     consecutive_hysteresis=False), "t": torch.arange(4)}
    torch.save(sd, tmp_path / "ok.pt")
    got = du.safe_load(str(tmp_path / "ok.pt"), map_location="cpu")
    assert got["frag"] == fragment_address(numel=5, start=2) and got["stage"] is ZeroStageEnum.gradients
    assert got["scaler"].cur_scale == 2.0**8 and torch.equal(got["t"], torch.arange(4))


def test_universal_loads_are_safe_only_inside_the_block(tmp_path):
    from deepspeed.checkpoint import universal_checkpoint as uc

    path = _hostile_file(tmp_path / "fp32.pt", tmp_path / "marker")
    with pytest.raises(RuntimeError):  # the block restores torch on the way out of an error too
        with du.safe_universal_loads():
            with pytest.raises(CheckpointError, match="the global"):
                uc.torch.load(path, weights_only=False)  # the call load_hp_checkpoint_state makes
            assert uc.torch.zeros(2).shape == (2,)  # everything else is torch's
            raise RuntimeError("leave the block")
    assert uc.torch is torch
    assert not (tmp_path / "marker").exists()


def test_converter_refuses_a_checkpoint_holding_code(tmp_path, capsys):
    src = tmp_path / "global_step1"
    src.mkdir()
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        _hostile_file(src / name, tmp_path / "marker")
    rc = du.main(["--input_folder", str(src), "--output_folder", str(tmp_path / "out"),
                  "--num_extract_workers", "1", "--num_merge_workers", "1", "--inject_missing_state"])
    assert rc == 3
    assert "needs the global" in capsys.readouterr().err
    assert not (tmp_path / "marker").exists()
    assert torch.load is du._torch_load  # torch.load is torch's again


def test_converter_refuses_worker_pools(tmp_path, capsys):
    rc = du.main(["--input_folder", str(tmp_path), "--output_folder", str(tmp_path / "out"),
                  "--num_extract_workers", "4", "--num_merge_workers", "1"])
    assert rc == 3 and "--num_extract_workers 1" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out")
