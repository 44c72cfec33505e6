"""``robust topo``: tables and JSON without a process group (simulated layout or a file)."""

from __future__ import annotations

import json

from robust_plugins.cli.main import main


def test_topo_table_sim(capsys):
    assert main(["topo", "--sim", "2x4", "--tp", "2", "--megatron", "--pp", "2"]) == 0
    out = capsys.readouterr().out
    assert "topology: 8 ranks, source sim:2x4" in out
    assert "rail   3          2     3 7" in out
    assert "megatron rank order" in out


def test_topo_json_from_env_and_file(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("ROBUST_TOPOLOGY_SIM", "2x2")
    assert main(["topo", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["world_size"] == 4 and data["groups"]["rail"][1]["ranks"] == [1, 3]

    path = tmp_path / "t.json"
    path.write_text(json.dumps({
        "a": {"switches": ["leaf0"], "ranks": [0, 1]},
        "b": {"switches": ["leaf1"], "ranks": [2, 3]},
    }))
    assert main(["topo", "--file", str(path), "--json"]) == 0  # the file wins over the env
    data = json.loads(capsys.readouterr().out)
    assert data["source"] == f"file:{path}"
    assert data["groups"]["switch0"] == [{"name": "leaf0", "ranks": [0, 1]}, {"name": "leaf1", "ranks": [2, 3]}]


def test_topo_uneven_and_errors(capsys, tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"a": {"ranks": [0, 1, 2]}, "b": {"ranks": [3]}}))
    assert main(["topo", "--file", str(path)]) == 0
    assert "no hierarchy: uneven nodes: 2 NVLink domains with rank counts 1 x 1, 1 x 3" in capsys.readouterr().out
    assert main(["topo", "--sim", "2x4", "--tp", "8"]) == 2
    assert "tensor parallel size 8" in capsys.readouterr().err
    assert main(["topo", "--sim", "2by4"]) == 2
