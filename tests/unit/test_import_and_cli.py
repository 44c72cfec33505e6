"""`import robust_plugins` is cheap; `robust check-config` validates files without DeepSpeed."""

import json
import subprocess
import sys

from robust_plugins.cli import check_config


def _py(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_import_does_not_import_hosts():
    got = _py("import sys, robust_plugins; print(sorted(m for m in ('deepspeed', 'megatron', 'triton') if m in sys.modules))")
    assert got == "[]"


def test_import_works_when_hosts_are_missing():
    # Hide the hosts the way an uninstalled package is hidden: find_spec returns None.
    code = (
        "import sys, importlib.util as u\n"
        "real = u.find_spec\n"
        "u.find_spec = lambda n, *a: None if n.split('.')[0] in ('deepspeed', 'megatron', 'triton') else real(n, *a)\n"
        "import robust_plugins\n"
        "print(robust_plugins.PluginConfig.from_dict({'compression': {'codec': 'int4'}}).describe())\n"
    )
    assert "codec=int4" in _py(code)


def test_deepspeed_patched_after_import_in_either_order():
    a = _py("import robust_plugins, deepspeed; print(getattr(deepspeed.initialize, '__robust_plugins_patch__', False))")
    b = _py("import deepspeed, robust_plugins; print(getattr(deepspeed.initialize, '__robust_plugins_patch__', False))")
    assert a.splitlines()[-1] == "True" and b.splitlines()[-1] == "True"


def test_check_config_cli(tmp_path):
    good = tmp_path / "ds.json"
    good.write_text(json.dumps({"zero_optimization": {"stage": 1, "reduce_bucket_size": 5e6,
                                                      "allgather_bucket_size": 5e6},
                                "robust_plugins": {"compression": {"codec": "int4"}}}))
    out = subprocess.run([sys.executable, "-m", "robust_plugins.cli.main", "check-config", str(good)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "codec=int4" in out.stdout and "ZeRO stage 1" in out.stdout and "warning" not in out.stdout
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"robust_plugins": {"compression": {"codec": "int4", "block_size": 100}}}))
    out = subprocess.run([sys.executable, "-m", "robust_plugins.cli.main", "check-config", str(bad)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "block_size = 100" in out.stderr and "power of two" in out.stderr


def test_check_config_flags_zero3_and_cpu_buckets(tmp_path):
    p = tmp_path / "z3.json"
    p.write_text(json.dumps({"zero_optimization": {"stage": 4}, "robust_plugins": {"compression": {}}}))
    text = "\n".join(check_config.check(str(p)))
    assert "ERROR: zero_optimization.stage = 4" in text
    p.write_text(json.dumps({"zero_optimization": {"stage": 3}, "robust_plugins": {"compression": {"codec": "int8"}}}))
    text = "\n".join(check_config.check(str(p)))  # ZeRO-3's reduce-scatter is compressed
    assert "ERROR" not in text and "ZeRO-3's gradient reduce-scatter" in text
    p.write_text(json.dumps({"zero_optimization": {"stage": 3}, "robust_plugins": {"compression": {"codec": "sign"}}}))
    assert "ERROR: compression.codec = 'sign' with ZeRO-3" in "\n".join(check_config.check(str(p)))
    p.write_text(json.dumps({"zero_optimization": {"stage": 3}, "robust_plugins": {
        "compression": {"codec": "auto"}, "topology": {"hierarchical": True}}}))
    text = "\n".join(check_config.check(str(p)))
    assert "ERROR" not in text and "reduce-scatter (node first" in text
    p.write_text(json.dumps({"zero_optimization": {"stage": 2}, "robust_plugins": {"compression": {}}}))
    assert "reduce_bucket_size" in "\n".join(check_config.check(str(p)))


def test_check_config_reports_checkpoint_block(tmp_path):
    p = tmp_path / "ck.json"
    p.write_text(json.dumps({"zero_optimization": {"stage": 0}, "robust_plugins": {"checkpoint": {"keep": 2}}}))
    text = "\n".join(check_config.check(str(p)))
    assert "verified and atomic" in text and "keep=2" in text and "checkpoint.dir is not set" in text
    p.write_text(json.dumps({"zero_optimization": {"stage": 4}, "robust_plugins": {"checkpoint": {"dir": "x"}}}))
    text = "\n".join(check_config.check(str(p)))
    assert "ERROR: zero_optimization.stage = 4" in text and "dir is not set" not in text
    p.write_text(json.dumps({"zero_optimization": {"stage": 3}, "robust_plugins": {"checkpoint": {"dir": "x"}}}))
    text = "\n".join(check_config.check(str(p)))  # ZeRO-3 checkpoints are supported
    assert "ERROR" not in text and "verified and atomic" in text
