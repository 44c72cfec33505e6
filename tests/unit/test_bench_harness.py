"""Pure parts of the launch and benchmark harness: command lines, markdown sections, verdicts."""

from __future__ import annotations

import argparse
import json
import sys

import pytest

from robust_plugins.cli.bench.compression import (
    check_comparable, compression_rows, known_miss_notes, load_results, loss_vs_vanilla, run_compression, seeds_in,
)
from robust_plugins.cli.bench.writer import write_section
from robust_plugins.errors import ConfigError
from robust_plugins.launch import first_traceback, launch_env, rank_tails, torchrun_command


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


def test_rank_tails_keeps_each_ranks_last_lines():
    log = "\n".join(["[default0]:a", "[default1]:b", "torchrun summary", "[default0]:c",
                     "[default1]:terminate called without an active exception", "[default0]:d"])
    assert rank_tails(log, lines=2) == ("[default0]:c\n[default0]:d\n[default1]:b\n"
                                        "[default1]:terminate called without an active exception")
    assert rank_tails("no ranks here") == ""


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


def _result(name, seed, val_loss, bytes_=1000, sha="a", err=None, step_s=1.0):
    return {"name": name, "seed": seed, "val_loss": val_loss, "median_step_time_s": step_s,
            "wire": {"rank0_median_grad_bytes_per_step": bytes_}, "param_sha256": f"{sha}{seed}",
            "codec_error": {"rel_error": err} if err is not None else None, "plugin_active": name != "vanilla",
            "steps": 100, "world_size": 4, "preset": "small", "micro_batch": 8, "n_params": 880_000,
            "zero_stage": 1, "dtype": "torch.float32", "date": "2026-12-01T00:00:00",
            "val_windows": {"seed": 0, "batches": 32, "windows": 1024},
            "versions": {"torch": "t", "deepspeed": "d"}}


def _runs(name, losses, **kw):
    return [_result(name, seed, loss, **kw) for seed, loss in enumerate(losses)]


def _rows(results, codecs):
    rows, misses = compression_rows(results, codecs)
    return {row[0]: row for row in rows}, misses


def test_loss_uses_the_ratio_of_seed_means_not_the_mean_of_ratios():
    # Per seed: +1.2 % and -0.07 % (mean of ratios +0.57 %, over int8's 0.5 %); ratio of means +0.25 %.
    van, int8 = _runs("vanilla", [1.0, 3.0]), _runs("int8", [1.012, 2.998], bytes_=254)
    s = loss_vs_vanilla(van, int8)
    assert s.mean == pytest.approx(2.005) and s.delta == pytest.approx(0.0025)
    assert s.lo == pytest.approx(-0.002 / 3) and s.hi == pytest.approx(0.012)
    rows, misses = _rows({"vanilla": van, "int8": int8}, ["int8"])
    assert rows["int8"][-1] == "ok" and misses == []
    assert rows["int8"][4:7] == ["2.0050", "+0.25 %", "-0.07 .. +1.20 %"]
    assert rows["vanilla (fp32)"][4] == "2.0000"


def test_loss_miss_when_the_means_differ_even_if_one_seed_agrees():
    van = _runs("vanilla", [2.0, 2.0, 2.0])
    sign = _runs("sign", [2.0, 2.3, 2.3], bytes_=35)
    rows, misses = _rows({"vanilla": van, "sign": sign}, ["sign"])
    row = rows["sign (sign_mode gradient)"]
    assert row[-1] == "MISS (loss)" and misses == ["sign: loss"]
    assert row[5] == "+10.00 %" and row[6] == "+0.00 .. +15.00 %"


def test_momentum_row_counts_step_bytes_after_the_freeze_and_the_run_average():
    # 1-bit Adam: fp32 gradients in backward for the 2 freeze steps, then the 1-bit momentum in step.
    van = _runs("vanilla", [2.0, 2.0], bytes_=1000)
    mom = _runs("sign-momentum", [2.02, 2.04])
    for r in mom:
        r["robust_plugins_block"] = {"compression": {"codec": "sign", "sign_mode": "momentum", "freeze_steps": 2}}
        r["wire"] = {"rank0_median_grad_bytes_per_step": 0, "rank0_grad_bytes_per_step": [1000, 1000, 0, 0, 0, 0],
                     "rank0_step_bytes_per_step": [0, 0, 35, 35, 36, 35]}
    rows, misses = _rows({"vanilla": van, "sign-momentum": mom}, ["sign-momentum"])
    row = rows["sign (sign_mode momentum, freeze_steps 2)"]
    assert row[2] == "0.035x after freeze; run avg 0.357x"
    assert row[-1] == "ok" and misses == []
    for r in mom:
        r["wire"]["rank0_step_bytes_per_step"] = [0, 0, 41, 41, 41, 41]
    rows, misses = _rows({"vanilla": van, "sign-momentum": mom}, ["sign-momentum"])
    assert misses == ["sign-momentum: bytes"]


def test_bytes_error_and_step_time_come_from_the_right_runs():
    van = _runs("vanilla", [2.0, 2.0], step_s=1.0)
    int8 = [_result("int8", 0, 2.0, bytes_=254, err=0.01, step_s=1.0),
            _result("int8", 1, 2.0, bytes_=900, err=None, step_s=2.0)]
    rows, misses = _rows({"vanilla": van, "int8": int8}, ["int8"])
    # Seed 0 only for bytes and the one-bucket error; step time is the mean over seeds.
    assert rows["int8"][2] == "0.254x" and rows["int8"][3] == "1.00e-02" and rows["int8"][7] == "1.50x"
    assert rows["int8"][-1] == "ok"
    int8[0]["wire"]["rank0_median_grad_bytes_per_step"] = 300
    assert _rows({"vanilla": van, "int8": int8}, ["int8"])[1] == ["int8: bytes"]


def test_codec_none_must_match_vanilla_bitwise_for_every_seed():
    van = _runs("vanilla", [2.0, 2.1])
    none = _runs("none", [2.0, 2.1])
    assert _rows({"vanilla": van, "none": none}, ["none"])[0]["none"][-1] == "ok"
    none[1]["param_sha256"] = "other"
    rows, misses = _rows({"vanilla": van, "none": none}, ["none"])
    assert rows["none"][-1] == "MISS" and misses == ["none: final parameters differ from vanilla (seeds [1])"]


def test_seeds_must_pair_with_vanilla():
    with pytest.raises(ConfigError, match="seeds"):
        loss_vs_vanilla(_runs("vanilla", [2.0, 2.0]), [_result("int8", 0, 2.0), _result("int8", 0, 2.0)])
    with pytest.raises(ConfigError, match="seeds"):
        loss_vs_vanilla(_runs("vanilla", [2.0, 2.0]), [_result("int8", 0, 2.0)])


def test_known_miss_note_only_for_a_loss_miss_of_a_known_codec():
    assert len(known_miss_notes(["sign: loss"])) == 1 and "sign_ablation" in known_miss_notes(["sign: bytes, loss"])[0]
    assert known_miss_notes(["sign: bytes"]) == [] and known_miss_notes(["int8: loss"]) == []


def test_runs_that_differ_in_setup_or_validation_windows_are_refused():
    results = {"vanilla": _runs("vanilla", [2.0]), "int8": _runs("int8", [2.0])}
    check_comparable(results)
    results["int8"][0]["val_windows"] = {"seed": 1, "batches": 32, "windows": 1024}
    with pytest.raises(ConfigError, match="val_windows"):
        check_comparable(results)


def _write_results(out, results):
    out.mkdir(exist_ok=True)
    for runs in results.values():
        for r in runs:
            (out / f"{r['name']}-seed{r['seed']}.json").write_text(json.dumps(r))


def test_load_results_finds_seeds_and_names_missing_files(tmp_path):
    _write_results(tmp_path, {"vanilla": _runs("vanilla", [2.0, 2.1]), "int8": _runs("int8", [2.0, 2.1])})
    (tmp_path / "vanilla-seed1.json.bak").write_text("{}")
    assert seeds_in(tmp_path) == [0, 1]
    loaded = load_results(tmp_path, ["vanilla", "int8"], [0, 1])
    assert [r["val_loss"] for r in loaded["int8"]] == [2.0, 2.1]
    with pytest.raises(ConfigError, match=r"int4-seed0.*int4-seed1"):
        load_results(tmp_path, ["vanilla", "int4"], [0, 1])
    with pytest.raises(ConfigError, match="vanilla-seed2"):
        load_results(tmp_path, ["vanilla"], [0, 1, 2])
    old = tmp_path / "old"
    old.mkdir()
    (old / "vanilla.json").write_text("{}")
    with pytest.raises(ConfigError, match="older version"):
        load_results(old, ["vanilla"], seeds_in(old))


def test_from_results_writes_the_section(tmp_path, capsys):
    out = tmp_path / "run"
    _write_results(out, {"vanilla": _runs("vanilla", [2.0, 2.2]), "int8": _runs("int8", [2.004, 2.204], bytes_=254),
                         "sign": _runs("sign", [2.3, 2.5], bytes_=35)})
    md = tmp_path / "BENCHMARKS.md"
    args = argparse.Namespace(from_results=str(out), seeds=None, codecs=["int8", "sign"], write=str(md),
                              strict=True, out_dir=None, steps=100, nproc=4, preset="small", timeout=None,
                              section="compression", freeze_steps=20)
    assert run_compression(args) == 1  # --strict and sign misses its loss bound
    text = md.read_text()
    assert "--seeds 2 --codecs int8 sign --write" in text and "seeds 0, 1; validation: 1024 fixed" in text
    assert "| int8 | 254 B | 0.254x |" in text and "| ok |" in text and "MISS (loss)" in text
    assert "Vanilla validation loss by seed: 2.0000 (seed 0), 2.2000 (seed 1)." in text
    assert "sign misses its loss target" in text and "about 1 %" in text
    assert "targets missed: sign: loss" in capsys.readouterr().out
    args.section = "compression-sign"  # a second marked section; the first one stays
    run_compression(args)
    text = md.read_text()
    assert "<!-- bench:compression-sign:start -->" in text and "<!-- bench:compression:start -->" in text
    assert "--codecs int8 sign --section compression-sign --write" in text
    args.section = "compression"
    args.seeds = 3
    with pytest.raises(ConfigError, match="vanilla-seed2"):
        run_compression(args)
    args.seeds = 0
    with pytest.raises(ConfigError, match="at least one seed"):
        run_compression(args)
