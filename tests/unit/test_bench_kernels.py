"""``robust bench kernels``: byte accounting, the BENCHMARKS.md section, a tiny CPU run."""

from __future__ import annotations

from robust_plugins.cli.bench import kernels as bench_kernels
from robust_plugins.cli.bench.writer import write_section
from robust_plugins.cli.main import main


def test_traffic_bytes_count_every_input_and_output_once():
    n, bs = 1024, 256
    wire = n + 4 * 4  # int8 codes + 4 fp32 scales
    assert bench_kernels.traffic_bytes("quantize_ef", n, "int8", bs, 4) == 3 * 4 * n + wire
    assert bench_kernels.traffic_bytes("dequantize", n, "int8", bs, 4) == wire + 4 * n
    assert bench_kernels.traffic_bytes("reduce_requantize", n, "int8", bs, 4) == 5 * wire + 8 * n


def test_a_cpu_run_fills_the_cpu_rows_and_keeps_the_gpu_part(tmp_path, capsys):
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\n<!-- bench:compression:start -->\nkept\n<!-- bench:compression:end -->\n")
    rc = main(["bench", "kernels", "--device", "cpu", "--sizes-mb", "0.0625", "--kernels", "dequantize",
               "--codecs", "int8", "--repeats", "1", "--write", str(md)])
    assert rc == 0
    text = md.read_text()
    assert "kept" in text and text.count("<!-- bench:kernels:start -->") == 1
    assert "| 0.0625 MB | dequantize | int8 | eager reference |" in text
    assert "Not measured yet (no GPU in this session)" in text
    # A later GPU run replaces only the GPU part.
    write_section(md, "kernels-gpu", "gpu rows")
    main(["bench", "kernels", "--device", "cpu", "--sizes-mb", "0.0625", "--kernels", "dequantize",
          "--codecs", "sign", "--repeats", "1", "--write", str(md)])
    text = md.read_text()
    assert "gpu rows" in text and "| sign |" in text and "| int8 |" not in text
