"""``robust bench comm`` table building from made-up worker results (the run itself needs root)."""

from __future__ import annotations

import argparse

from robust_plugins.cli.bench import comm as bench_comm
from robust_plugins.cli.main import build_parser


def _result(fp32_s, int8_s):
    return {"world_size": 4, "numel": 10, "methods": {
        "flat fp32": {"times_s": [fp32_s, fp32_s * 3, fp32_s], "rel_error": 0.0},
        "hier int8": {"times_s": [int8_s, int8_s], "rel_error": 0.0099},
    }}


def test_rows_give_medians_and_speedups_per_rate():
    results = {"10gbit": _result(0.3, 1.2), "200mbit": _result(4.0, 1.6)}
    rows = bench_comm.rows(results, ["flat fp32", "hier int8", "flat int4"])
    assert rows[0][:5] == ["flat fp32", "300", "1.00x", "4000", "1.00x"]
    assert rows[1][:6] == ["hier int8", "1200", "0.25x", "1600", "2.50x", "9.9e-03"]
    assert rows[2][:5] == ["flat int4", "-", "-", "-", "-"]


def test_parser_and_command_line_round_trip():
    args = build_parser("bench").parse_args(
        ["bench", "comm", "--rates", "1gbit", "50mbit", "--mbytes", "4", "--write", "B.md"])
    assert args.rates == ["1gbit", "50mbit"] and args.mbytes == 4.0
    line = bench_comm.command_line(args)
    assert line == ("robust bench comm --sim-nodes 2 --ranks-per-node 2 --rates 1gbit 50mbit --mbytes 4 "
                    "--repeats 3 --write B.md")
    again = build_parser("bench").parse_args(line.split()[1:])
    assert bench_comm.command_line(again) == line
    text = bench_comm.render(args, {"1gbit": _result(0.3, 0.2)} | {"50mbit": _result(2.0, 0.5)})
    assert "| hier int8 | 200 | 1.50x | 500 | 4.00x |" in text and isinstance(args, argparse.Namespace)


def test_target_rows_judge_the_issue_targets():
    def res(times, choice=None):
        out = {"methods": {k: {"times_s": [v], "rel_error": 1e-8 if k == "hier fp32" else 0.01}
                           for k, v in times.items()}}
        for k in times:
            if k.endswith("auto"):
                out["methods"][k]["choice"] = choice
        return out

    results = {
        "10gbit": res({"flat fp32": 1.0, "flat bf16": 1.2, "flat auto": 1.04, "hier fp32": 2.0}, "none"),
        "200mbit": res({"flat fp32": 10.0, "flat bf16": 5.0, "hier int8": 3.0, "hier int4": 3.5,
                        "flat auto": 4.0, "hier fp32": 8.0}, "int8"),
    }
    rows = {r[0]: r[1:] for r in bench_comm.target_rows(results)}
    assert rows["200mbit: hier int8 >= 2.5x flat fp32"] == ["3.33x", "ok"]
    assert rows["200mbit: hier int8 >= 1.4x flat bf16"] == ["1.67x", "ok"]
    assert rows["200mbit: hier int4 >= 3x flat fp32"] == ["2.86x", "MISS"]
    assert rows["200mbit: flat auto picks a compressed codec and beats flat fp32"] == ["chose int8, 2.50x", "ok"]
    assert rows["10gbit: flat auto within 5 % of the fastest fixed method (flat fp32)"] == [
        "chose none, 1.04x its time", "ok"]
    assert rows["hier fp32 equals flat fp32 up to summation order"] == ["rel. error 1.0e-08", "ok"]


def test_train_rows_and_targets():
    def res(times, losses, choice):
        methods = {k: {"times_s": [v], "val_loss": losses[k], "params": 6_600_704} for k, v in times.items()}
        methods["plugin hier auto"]["choice"] = choice
        return {"methods": methods}

    results = {
        "10gbit": res({"ddp fp32": 0.30, "ddp fp16_compress_hook": 0.32, "plugin hier auto": 0.33},
                      {"ddp fp32": 3.0, "ddp fp16_compress_hook": 3.0, "plugin hier auto": 3.0}, "none"),
        "200mbit": res({"ddp fp32": 1.8, "ddp fp16_compress_hook": 1.0, "plugin hier auto": 0.7},
                       {"ddp fp32": 3.0, "ddp fp16_compress_hook": 3.0, "plugin hier auto": 3.03}, "int8"),
    }
    rows = bench_comm.train_rows(results)
    assert rows[2] == ["plugin hier auto", "330", "0.91x", "3.0000", "700", "2.57x", "3.0300",
                       "10gbit: none. 200mbit: int8."]

    targets = {r[0]: r[1:] for r in bench_comm.train_target_rows(results)}
    slow = targets["200mbit: plugin hier auto >= 1.3x faster than fp16_compress_hook, val loss no worse (+0.5 %)"]
    assert slow == ["1.43x, val loss +1.00%", "MISS"]  # fast enough, but the loss is 1 % worse
    fast = targets["10gbit: plugin hier auto within 5 % of the fastest fixed ddp method (ddp fp32)"]
    assert fast == ["chose none, 1.10x its time", "MISS"]
    # Rounds that chose differently: no "|" in a Markdown cell.
    results["10gbit"]["methods"]["plugin hier auto"]["choice"] = "none | flat bf16_allreduce"
    assert bench_comm.train_rows(results)[2][-1] == "10gbit: none; another round: flat bf16_allreduce. 200mbit: int8."
    assert not any("|" in cell for row in bench_comm.train_target_rows(results) for cell in row)


def test_a_single_rate_is_judged_only_by_the_targets_of_its_kind():
    one = {"methods": {"flat fp32": {"times_s": [1.0], "rel_error": 0.0},
                       "flat auto": {"times_s": [1.02], "rel_error": 0.0, "choice": "none"},
                       "hier int8": {"times_s": [3.0], "rel_error": 0.01}}}
    rows = [r[0] for r in bench_comm.target_rows({"10gbit": one})]
    assert rows == ["10gbit: flat auto within 5 % of the fastest fixed method (flat fp32)"]
    slow = [r[0] for r in bench_comm.target_rows({"200mbit": one})]
    assert slow and all(r.startswith("200mbit: ") for r in slow) and not any("within 5 %" in r for r in slow)
    assert bench_comm.target_rows({"2gbit": one}) == []  # neither slow nor fast: no targets
    assert bench_comm.link_kind("1gbit") == "slow" and bench_comm.link_kind("5gbit") == "fast"


def test_ds_training_targets_and_a_hung_powersgd_row():
    def m(t, loss, **kw):
        return {"times_s": [t], "val_loss": loss, "params": 10, **kw}

    results = {
        "200mbit": {"methods": {"ddp fp32": m(1.8, 3.0), "ddp fp16_compress_hook": m(1.0, 3.0),
                                "ds fp32": m(1.9, 3.0), "ds hier auto": m(0.7, 2.99, choice="hier int8"),
                                "ddp powerSGD_hook": {"failed": "hung or failed within the 60 s bound (x)"}}},
        "10gbit": {"methods": {"ddp fp32": m(0.25, 3.0), "ddp fp16_compress_hook": m(0.3, 3.0),
                               "ds fp32": m(0.30, 3.0), "ds hier auto": m(0.31, 3.0, choice="flat none"),
                               # auto too, so never "the fastest fixed method"
                               "ds hier auto no-overlap": m(0.20, 3.0, choice="flat none")}},
    }
    rows = {r[0]: r[1:] for r in bench_comm.train_rows(results)}
    assert rows["ddp powerSGD_hook"][:4] == ["hung or failed within the 60 s bound (x)", "-", "-", "not run"]
    assert rows["ds hier auto"][-1] == "200mbit: hier int8. 10gbit: flat none."
    t = {r[0]: r[1:] for r in bench_comm.train_target_rows(results)}
    assert t["200mbit: ds hier auto >= 1.3x faster than fp16_compress_hook, val loss no worse (+0.5 %)"] == [
        "1.43x, val loss -0.33%", "ok"]
    assert t["10gbit: ds hier auto within 5 % of the fastest fixed ds method (ds fp32)"] == [
        "chose flat none, 1.03x its time", "ok"]
    assert t["10gbit: ds hier auto within 5 % of the fastest fixed method (ddp fp32)"] == [
        "chose flat none, 1.24x its time", "MISS"]
