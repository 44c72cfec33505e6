"""The wheel installs robust_plugins and triton_ops only: no generic top-level `patches`/`recipes`."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


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


def test_no_tracked_symlinks():
    # patches/ and recipes/ reach the wheel through setup.py's package_dir, not links inside
    # robust_plugins/ (a link hides the boundary from the import graph and from Windows checkouts).
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-s"], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        pytest.skip(f"not a git checkout: {out.stderr.strip()}")
    links = [line.split("\t", 1)[1] for line in out.stdout.splitlines() if line.startswith("120000 ")]
    assert links == [], links


def test_the_source_tree_imports_patches_and_recipes_as_subpackages():
    code = ("import robust_plugins.patches.deepspeed as d, robust_plugins.recipes.deepspeed_gpt as r; "
            "print(d.__file__); print(r.__file__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(ROOT / "patches" / "deepspeed.py"),
                                  str(ROOT / "recipes" / "deepspeed_gpt" / "__init__.py")]
