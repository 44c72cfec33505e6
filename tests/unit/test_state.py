"""CompressionState: validation, residual bookkeeping, checkpoint round trip; single-rank collective."""

from __future__ import annotations

import io

import pytest
import torch

from robust_plugins.comm import CompressionState, compressed_all_reduce, compressed_reduce, WireCounter
from robust_plugins.config import CompressionConfig
from robust_plugins.errors import CheckpointError, ConfigError, RobustPluginsError


def test_arguments_are_validated_by_the_config_schema():
    with pytest.raises(ConfigError, match="int3"):
        CompressionState(codec="int3")
    with pytest.raises(ConfigError, match="block_size = 100"):
        CompressionState(block_size=100)
    with pytest.raises(ConfigError, match="error_feedback"):
        CompressionState(codec="sign", error_feedback=False)


def test_from_config():
    cfg = CompressionConfig(codec="int4", block_size=128, error_feedback=False, min_numel=10)
    st = CompressionState.from_config(cfg)
    assert (st.codec, st.block_size, st.error_feedback, st.min_numel) == ("int4", 128, False, 10)


def test_residuals_are_created_once_and_size_changes_raise():
    st = CompressionState()
    r = st.sender_residual(("ddp", 0), 100)
    assert r.dtype == torch.float32 and r.shape == (100,) and not r.any()
    assert st.sender_residual(("ddp", 0), 100) is r
    with pytest.raises(RobustPluginsError, match=r"\('ddp', 0\).* 100 .* 120"):
        st.sender_residual(("ddp", 0), 120)
    st.server_residual(("ddp", 0), 50)
    with pytest.raises(RobustPluginsError, match="50 .* 64"):
        st.server_residual(("ddp", 0), 64)
    st.forget(("ddp", 0))
    assert st.sender_residual(("ddp", 0), 120).shape == (120,)


def test_unstable_keys_are_refused():
    with pytest.raises(RobustPluginsError, match="not allowed"):
        CompressionState().sender_residual(object(), 4)


def test_state_dict_round_trip_through_weights_only_load():
    st = CompressionState(codec="int4", block_size=64)
    st.sender_residual(("ddp", 3), 10).fill_(1.5)
    st.sender_residual("3", 5).fill_(2.0)
    st.server_residual(("ddp", 3), 4).fill_(-1.0)
    buf = io.BytesIO()
    torch.save(st.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)

    new = CompressionState(codec="int4", block_size=64)
    new.load_state_dict(sd)
    assert new.keys() == st.keys()
    assert torch.all(new.sender_residual(("ddp", 3), 10) == 1.5)
    assert torch.all(new.sender_residual("3", 5) == 2.0)  # "3" and ("ddp", 3) stay distinct
    assert torch.all(new.server_residual(("ddp", 3), 4) == -1.0)
    # The loaded copy is independent of the saved state.
    new.sender_residual(("ddp", 3), 10).zero_()
    assert torch.all(st.sender_residual(("ddp", 3), 10) == 1.5)


def test_load_refuses_other_codec_or_block_size():
    sd = CompressionState(codec="int8", block_size=256).state_dict()
    with pytest.raises(CheckpointError, match="codec='int8'.*codec='int4'"):
        CompressionState(codec="int4").load_state_dict(sd)
    with pytest.raises(CheckpointError, match="block_size=256.*block_size=128"):
        CompressionState(block_size=128).load_state_dict(sd)
    with pytest.raises(CheckpointError, match="lacks"):
        CompressionState().load_state_dict({"codec": "int8"})


# -- the collectives without a process group: a world of one -------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_single_process_all_reduce_applies_the_codec(dtype):
    torch.manual_seed(0)
    x = torch.randn(3, 333).to(dtype)
    y = x.clone()
    with WireCounter() as wc:
        out = compressed_all_reduce(y, codec="int8")
    assert out is y and y.dtype == dtype and y.shape == x.shape
    assert wc.bytes_sent == 0 and not wc.calls
    assert not torch.equal(y, x) or dtype != torch.float32  # int8 is lossy
    torch.testing.assert_close(y.float(), x.float(), atol=x.float().abs().max().item() / 127, rtol=0)


def test_state_decides_and_conflicts_are_errors():
    st = CompressionState(codec="int4", block_size=64)
    t = torch.randn(100)
    compressed_all_reduce(t, state=st, key="k")
    assert st.sender_residual("k", 100).abs().sum() > 0
    with pytest.raises(ConfigError, match="codec='int8' conflicts"):
        compressed_all_reduce(t, codec="int8", state=st, key="k")
    with pytest.raises(ConfigError, match="'mean'"):
        compressed_all_reduce(t, op="mean")
    with pytest.raises(RobustPluginsError, match="contiguous"):
        compressed_all_reduce(torch.randn(4, 4).t())
    with pytest.raises(ConfigError, match="dst = 1"):
        compressed_reduce(t, 1, codec="int8")


def test_default_key_is_by_size():
    st = CompressionState()
    compressed_all_reduce(torch.randn(300), state=st)
    assert st.keys() == [repr(("default", 300))]


def test_min_numel_sends_small_buckets_uncompressed():
    st = CompressionState(codec="sign", min_numel=1000)
    x = torch.randn(999)
    y = x.clone()
    compressed_all_reduce(y, state=st, key="small")
    assert torch.equal(x, y) and st.keys() == []


@pytest.mark.timeout(60)
def test_residual_norm_reads_the_host_once_per_device(monkeypatch):
    # On a GPU a host read per residual was a sync per bucket at every telemetry window.
    st = CompressionState(codec="int8")
    st.sender_residual(("a", 0), 10).fill_(1.5)
    st.sender_residual(("a", 1), 3).fill_(-2.0)
    st.server_residual(("a", 0), 4).fill_(0.5)
    reads = []
    original = torch.Tensor.__float__
    monkeypatch.setattr(torch.Tensor, "__float__", lambda t: reads.append(1) or original(t))
    assert st.residual_sq_norm() == pytest.approx(10 * 2.25 + 3 * 4.0 + 4 * 0.25)
    assert len(reads) == 1
