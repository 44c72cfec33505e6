"""Bad input is refused at deepspeed.initialize, before DeepSpeed builds anything.

Every case here raises from the robust_plugins wrapper before the original ``deepspeed.initialize``
runs, so no process group is needed except for building a real PipelineModule.
"""

import os

import pytest
import torch

import robust_plugins  # noqa: F401
from robust_plugins.errors import ConfigError, HostVersionError, UnsupportedError

deepspeed = pytest.importorskip("deepspeed")

pytestmark = pytest.mark.timeout(120)

BASE = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1}}


def _init(block, **extra):
    cfg = {**BASE, **extra, "robust_plugins": block}
    model = torch.nn.Linear(4, 4)
    return deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)


@pytest.mark.parametrize(
    "block, error, needles",
    [
        ({"compression": {"codec": "int8", "bucket": 1}}, ConfigError, ["compression.bucket", "Allowed keys"]),
        ({"compresion": {"codec": "int8"}}, ConfigError, ["Did you mean 'compression'"]),
        ({"compression": {"codec": "int8", "block_size": 256.0}}, ConfigError, ["block_size must be an integer"]),
        ({"compression": {"codec": "fp8"}}, ConfigError, ["'fp8'", "Allowed: none, bf16, int8, int4, sign"]),
        ({"compression": {"codec": "int8", "block_size": 100}}, ConfigError, ["power of two"]),
        ({"compression": {"codec": "int8", "block_size": 8192}}, ConfigError, ["between 32 and 4096"]),
        ({"compression": {"codec": "sign", "error_feedback": False}}, ConfigError, ["requires error_feedback"]),
        ({"compression": {"codec": "int8", "warmup_steps": -3}}, ConfigError, ["warmup_steps = -3"]),
    ],
)
def test_bad_block_refused_at_initialize(block, error, needles):
    with pytest.raises(error) as info:
        _init(block)
    for n in needles:
        assert n in str(info.value)


def test_unknown_zero_stage_refused_naming_the_stage():
    # ZeRO-3 is served (test_deepspeed_zero3.py); what refuses there is in tests/unit/test_scale_refusals.py.
    with pytest.raises(UnsupportedError, match=r"zero_optimization.stage = 4 is not a ZeRO stage; allowed: 0, 1, 2, 3"):
        _init({"compression": {"codec": "int8"}}, zero_optimization={"stage": 4})


def test_config_file_path_and_args_are_read(tmp_path):
    import argparse
    import json

    p = tmp_path / "ds.json"
    p.write_text(json.dumps({**BASE, "robust_plugins": {"compression": {"codec": "int9"}}}))
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="int9"):
        deepspeed.initialize(model=model, config=str(p))
    with pytest.raises(ConfigError, match="int9"):
        deepspeed.initialize(args=argparse.Namespace(deepspeed_config=str(p)), model=model)


def test_pipeline_module_refuses_what_its_compression_does_not_serve():
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule

    from robust_plugins.launch import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    deepspeed.init_distributed(dist_backend="gloo")
    try:
        pipe = PipelineModule(layers=[torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)], num_stages=1)
        # Compression serves the pipeline engine's DP reduction (test_deepspeed_pipeline.py), not
        # overlapped with backward (the pipeline reduces at the batch's end).
        with pytest.raises(UnsupportedError, match=r"pipeline engine does not support compression.overlap = true"):
            deepspeed.initialize(model=pipe, optimizer=torch.optim.SGD(pipe.parameters(), lr=0.1),
                                 config={**BASE, "zero_allow_untested_optimizer": True,
                                         "robust_plugins": {"compression": {"codec": "int8", "overlap": True}}})
    finally:
        dist.destroy_process_group()


def test_unsupported_deepspeed_version_named(monkeypatch):
    # On another DeepSpeed the import works (tests/integration/test_unsupported_deepspeed.py);
    # a config with the block is refused, naming the version and the range.
    from robust_plugins.patches import deepspeed as ds_patch

    ds_patch.undo()
    monkeypatch.setattr(deepspeed, "__version__", "0.21.0")
    try:
        ds_patch.install()
        with pytest.raises(HostVersionError, match=rf"deepspeed {ds_patch.RANGE.spec}; found deepspeed 0.21.0"):
            _init({"compression": {"codec": "int8"}})
    finally:
        monkeypatch.undo()
        ds_patch.undo()
        ds_patch.install()
