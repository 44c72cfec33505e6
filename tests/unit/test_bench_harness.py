"""Pure parts of the launch and benchmark harness: command lines, markdown sections, verdicts."""

from __future__ import annotations

import sys

import pytest

from robust_plugins.cli.bench import compression_rows, write_section
from robust_plugins.errors import ConfigError
from robust_plugins.launch import first_traceback, launch_env, torchrun_command


def test_torchrun_command_module_and_script():
    cmd = torchrun_command("pkg.mod", ["--x", 1], nproc=4, port=1234)
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert cmd[cmd.index("--nproc-per-node") + 1] == "4" and "1234" in cmd
    assert cmd[-4:] == ["-m", "pkg.mod", "--x", "1"]
    assert torchrun_command("job.py", [], nproc=1, port=1)[-1] == "job.py"


def test_launch_env_keeps_extension_cache_and_pins_threads():
    env = launch_env({"TORCH_EXTENSIONS_DIR": "/x", "OMP_NUM_THREADS": "8"}, {"A": "b"})
    assert env["TORCH_EXTENSIONS_DIR"] == "/x" and env["OMP_NUM_THREADS"] == "1"
    assert env["DS_ACCELERATOR"] == "cpu" and env["A"] == "b"
    assert launch_env({})["TORCH_EXTENSIONS_DIR"].endswith("torch_extensions")


def test_first_traceback_keeps_one_rank():
    log = "\n".join([
        "[r1]: Traceback (most recent call last):", "[r0]: noise", '[r1]:   File "x.py", line 1',
        "[r1]: ValueError: bad", "[r1]: later",
    ])
    assert first_traceback(log) == '[r1]: Traceback (most recent call last):\n[r1]:   File "x.py", line 1\n[r1]: ValueError: bad'


def test_write_section_creates_replaces_and_keeps_the_rest(tmp_path):
    md = tmp_path / "BENCHMARKS.md"
    write_section(md, "compression", "one")
    md.write_text(md.read_text() + "\ntrailer\n")
    write_section(md, "compression", "two")
    text = md.read_text()
    assert "two" in text and "one" not in text and text.endswith("trailer\n")
    assert text.count("<!-- bench:compression:start -->") == 1
    md.write_text("<!-- bench:compression:start -->\n")
    with pytest.raises(ConfigError, match="markers"):
        write_section(md, "compression", "three")


def _result(bytes_, loss, sha="a", err=None):
    return {"wire": {"rank0_median_grad_bytes_per_step": bytes_}, "final_loss_last10": loss,
            "median_step_time_s": 1.0, "param_sha256": sha, "codec_error": {"rel_error": err} if err else None}


def test_compression_verdicts():
    results = {"vanilla": _result(1000, 2.0), "none": _result(1000, 2.0), "int8": _result(254, 2.02, "b", 0.01),
               "sign": _result(35, 2.05, "c", 0.5)}
    rows, misses = compression_rows(results, ["none", "int8", "sign"])
    verdicts = {row[0]: row[-1] for row in rows}
    assert verdicts["none"] == "ok" and verdicts["sign"] == "ok"
    assert verdicts["int8"] == "MISS (loss)" and misses == ["int8: loss"]
