"""Model chunks (virtual pipeline stages) in MegatronCheckpointer's pure parts: the chunk and
plugin lists it accepts, and the per-chunk plugin state a checkpoint or snapshot holds."""

from __future__ import annotations

import pytest

from robust_plugins.errors import CheckpointError, ConfigError
from robust_plugins.megatron import _chunk_plugins, _chunks
from robust_plugins.patches.megatron_memory import load_plugin_states, plugin_states


class _Plugin:
    def __init__(self, steps: int = 0):
        self.steps = steps

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, sd: dict) -> None:
        self.steps = sd["steps"]


class _Chunk:
    def __init__(self, plugin=None):
        if plugin is not None:
            self.robust_plugins = plugin


def test_one_chunk_or_a_list_of_vpp_chunks_is_accepted():
    a, b = _Chunk(), _Chunk()
    assert _chunks(a, None) == [a] and _chunks([a], None) == [a] and _chunks((a, b), 2) == [a, b]


@pytest.mark.parametrize("given, vpp", [("one", 2), ("two", None), ("two", 3)])
def test_a_chunk_count_other_than_the_virtual_size_is_refused_naming_it(given, vpp):
    model = _Chunk() if given == "one" else [_Chunk(), _Chunk()]
    with pytest.raises(ConfigError, match=rf"virtual_pipeline_model_parallel_size = {vpp}; pass {vpp or 1}"):
        _chunks(model, vpp)


def test_plugins_default_to_each_chunks_own_and_must_match_the_chunk_count():
    p0, p1 = _Plugin(), _Plugin()
    chunks = [_Chunk(p0), _Chunk(p1)]
    assert _chunk_plugins(chunks, None) == [p0, p1]
    assert _chunk_plugins([_Chunk()], None) == [None]
    assert _chunk_plugins(chunks, [p1, p0]) == [p1, p0]
    with pytest.raises(ConfigError, match="got 1 plugin"):
        _chunk_plugins(chunks, p0)


def test_plugin_states_keep_the_one_chunk_format_and_list_several():
    assert plugin_states([_Plugin(3)]) == {"steps": 3} and plugin_states([None]) is None
    assert plugin_states([_Plugin(1), None]) == [{"steps": 1}, None]
    mine = [_Plugin(), _Plugin()]
    load_plugin_states(mine, [{"steps": 4}, {"steps": 5}], "ckpt")
    assert [p.steps for p in mine] == [4, 5]
    one = [_Plugin()]
    load_plugin_states(one, {"steps": 7}, "ckpt")
    assert one[0].steps == 7
    load_plugin_states([None, None], [None, {"steps": 1}], "ckpt")  # plugin off here: nothing to load


def test_plugin_states_that_do_not_fit_are_refused():
    with pytest.raises(CheckpointError, match="ckpt holds robust_plugins state of 1 model chunk"):
        load_plugin_states([_Plugin(), _Plugin()], {"steps": 1}, "ckpt")
    with pytest.raises(CheckpointError, match="no robust_plugins state for model chunk 1"):
        load_plugin_states([_Plugin(), _Plugin()], [{"steps": 1}, None], "ckpt")
