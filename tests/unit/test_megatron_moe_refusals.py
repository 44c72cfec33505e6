"""MoE layouts robust_plugins does not serve are refused with the key, the value and what is allowed
(``patches/megatron.py`` ``refuse_moe``, called by ``enable`` and ``MegatronCheckpointer``)."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("megatron.core")

from robust_plugins.errors import UnsupportedError  # noqa: E402
from robust_plugins.patches.megatron import refuse_moe  # noqa: E402


@dataclasses.dataclass
class _Config:  # the TransformerConfig fields refuse_moe reads
    num_moe_experts: int | None = 4
    moe_token_dispatcher_type: str = "alltoall"
    moe_grouped_gemm: bool = False
    tensor_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = 1
    pipeline_model_parallel_size: int = 1


def test_served_moe_layouts_and_dense_models_pass():
    from megatron.core.transformer.transformer_config import TransformerConfig

    for dispatcher in ("alltoall", "allgather"):
        refuse_moe(_Config(moe_token_dispatcher_type=dispatcher), "enable")
    refuse_moe(_Config(num_moe_experts=None, tensor_model_parallel_size=2, pipeline_model_parallel_size=2), "enable")
    refuse_moe(None, "enable")
    # megatron's own config carries the fields under these names
    real = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=2, num_moe_experts=4,
                             moe_token_dispatcher_type="alltoall", use_cpu_initialization=True)
    refuse_moe(real, "enable")
    assert all(hasattr(real, f.name) for f in dataclasses.fields(_Config))


@pytest.mark.parametrize("key,value,allowed", [
    ("moe_token_dispatcher_type", "flex", "alltoall, allgather"),
    ("moe_grouped_gemm", True, "False"),
    ("tensor_model_parallel_size", 2, "1 with experts"),
    ("expert_tensor_parallel_size", 2, "allowed: 1"),
    ("pipeline_model_parallel_size", 2, "1 with experts"),
])
def test_unserved_moe_layouts_are_refused_naming_key_value_and_allowed(key, value, allowed):
    with pytest.raises(UnsupportedError) as err:
        refuse_moe(dataclasses.replace(_Config(), **{key: value}), "robust_plugins.megatron.enable")
    msg = str(err.value)
    assert f"{key} = {value!r}" in msg and allowed in msg and "robust_plugins.megatron.enable" in msg, msg
