"""The ``topology`` sub-block of the one schema."""

from __future__ import annotations

import pytest

from robust_plugins.config import PluginConfig, TopologyConfig
from robust_plugins.errors import ConfigError


def test_hierarchical_block_parses_and_describes():
    cfg = PluginConfig.from_dict({"compression": {"codec": "int8"},
                                  "topology": {"hierarchical": True, "file": "topo.json"}})
    assert cfg.topology == TopologyConfig(hierarchical=True, file="topo.json")
    assert "topology(hierarchical=True, file=topo.json)" in cfg.describe()
    assert PluginConfig.from_dict({"compression": {}}).topology is None


def test_hierarchical_needs_the_compression_block():
    with pytest.raises(ConfigError, match='needs a robust_plugins.compression sub-block.*"codec": "none"'):
        PluginConfig.from_dict({"topology": {"hierarchical": True}})
    # Without hierarchical the block only names a file: allowed on its own.
    assert PluginConfig.from_dict({"topology": {"file": "t.json"}}).topology.file == "t.json"


@pytest.mark.parametrize("block,match", [
    ({"hierarchical": "yes"}, "hierarchical must be true or false"),
    ({"file": ""}, "file = '' is empty"),
    ({"file": 3}, "file must be a file path"),
    ({"hierachical": True}, "Did you mean 'hierarchical'"),
])
def test_bad_topology_blocks(block, match):
    with pytest.raises(ConfigError, match=match):
        PluginConfig.from_dict({"compression": {}, "topology": block})
