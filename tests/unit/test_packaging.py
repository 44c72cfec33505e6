"""The wheel installs robust_plugins and triton_ops only: no generic top-level `patches`/`recipes`."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_wheel_top_level_names(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=280,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    wheel = next(tmp_path.glob("robust_plugins-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"robust_plugins", "triton_ops"}, tops
    assert "robust_plugins/patches/deepspeed.py" in names
    assert {"robust_plugins/recipes/hf_trainer/baseline.json", "robust_plugins/recipes/hf_trainer/plugin.json"} <= set(names)
    # every recipe's JSON (the DeepSpeed configs and plugin blocks `robust` and the tests load)
    recipe_json = {f"robust_plugins/recipes/{p.relative_to(ROOT / 'recipes').as_posix()}"
                   for p in (ROOT / "recipes").rglob("*.json")}
    assert "robust_plugins/recipes/deepspeed_gpt/plugin.json" in recipe_json
    assert recipe_json <= set(names), sorted(recipe_json - set(names))
    meta = next(n for n in names if n.endswith("METADATA"))
    requires = [l for l in zipfile.ZipFile(wheel).read(meta).decode().splitlines() if l.startswith("Requires-Dist: torch")]
    assert requires and "==" not in requires[0], requires  # never pin torch in the package
