"""``make compat``: the host-version matrix. One venv per host set, a representative test subset in each.

Each set is the pinned CPU requirements (``requirements/cpu.txt``) with a few hosts moved to
another version. Its venv, under ``--root`` (default ``/work/compat-venvs``, never inside the
repository), is a copy of the set ``pinned`` (built once from the requirements) with the set's pins
installed on top by pip, whose cache and the machine's wheel folders serve every set; the checkout
goes in with ``pip install --no-deps -e``. Then the set's subset runs (DeepSpeed's CPU comm op is
built first, per venv). A venv already built is reused (``--rebuild`` starts it again).

Prints one Markdown row per set (set, versions, subset, result, seconds) and writes them to
``--out`` (default ``<root>/compat.md``). Exit status: 1 when a set failed, else 0.

    python tools/compat.py                       # every set
    python tools/compat.py deepspeed-0.18 hf-5.25 # some
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: The tests every set runs: the guards, the config schema, the import hook.
COMMON = ["tests/unit/test_patch_guard.py", "tests/unit/test_host_refusals.py", "tests/unit/test_host_ranges.py",
          "tests/unit/test_import_and_cli.py"]
#: Per host: what exercises its patches (one or two integration files each: minutes, not tens).
DEEPSPEED = ["tests/integration/test_deepspeed_bad_input.py", "tests/integration/test_deepspeed_compression.py",
             "tests/integration/test_unsupported_deepspeed.py"]
MEGATRON = ["tests/unit/test_megatron_patch.py", "tests/integration/test_megatron_compression.py"]
HF = ["tests/integration/test_hf_trainer.py"]
TORCH = ["tests/unit/test_torch_elastic_guard.py", "tests/fault/test_robust_run_defaults.py",
         "tests/fault/test_refusal_is_final.py"]

#: set name -> (pins over requirements/cpu.txt, test subset).
SETS: dict[str, tuple[list[str], list[str]]] = {
    "pinned": ([], DEEPSPEED + MEGATRON + TORCH),
    "deepspeed-0.18": (["deepspeed==0.18.9"], DEEPSPEED),
    "deepspeed-0.17": (["deepspeed==0.17.6"], DEEPSPEED),
    "deepspeed-0.16": (["deepspeed==0.16.9"], DEEPSPEED),
    "megatron-0.15": (["megatron-core==0.15.3"], MEGATRON),
    "megatron-0.14": (["megatron-core==0.14.0"], MEGATRON),
    "hf-5.25": (["transformers==5.25.0", "accelerate==1.16.0"], HF),
    "hf-4.57": (["transformers==4.57.6", "accelerate==1.11.0"], HF),
    "torch-2.14": (["torch==2.14.1"], TORCH + DEEPSPEED[:1]),
}

VERSIONS = ("torch", "deepspeed", "megatron-core", "transformers", "accelerate")


def _run(cmd: list[str], log, env: dict | None = None, timeout: float = 3600) -> int:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode


def _pip(venv: Path, args: list[str], log) -> None:
    rc = _run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
               *args], log)
    if rc != 0:
        raise RuntimeError(f"pip install {' '.join(args)} failed in {venv} (exit {rc}); see the log")


def build(root: Path, name: str, rebuild: bool, log) -> Path:
    """The set's venv: ``pinned`` from the requirements, the others a copy of it plus their pins."""
    venv, done = root / name, root / f"{name}.built"  # the mark lives outside: a copy must not carry it
    if venv.exists() and not rebuild and done.exists():
        return venv
    done.unlink(missing_ok=True)
    shutil.rmtree(venv, ignore_errors=True)
    if name == "pinned":
        _run([sys.executable, "-m", "venv", str(venv)], log)
        _pip(venv, ["-r", str(REPO / "requirements" / "cpu.txt")], log)
    else:
        base = build(root, "pinned", False, log)
        # cp -a: keeps the torch extension cache's mtimes (a plain copy makes ninja rebuild it).
        _run(["cp", "-a", str(base), str(venv)], log)
        _pip(venv, SETS[name][0], log)
    _pip(venv, ["--no-deps", "-e", str(REPO)], log)
    done.touch()
    return venv


def versions(venv: Path) -> str:
    """``torch 2.13.0, deepspeed 0.19.8, ...`` as pip's metadata says."""
    code = ("import importlib.metadata as m\n"
            f"for d in {VERSIONS!r}:\n"
            "    try: print(d, m.version(d))\n"
            "    except m.PackageNotFoundError: pass\n")
    out = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True).stdout
    return ", ".join(line.strip() for line in out.splitlines())


def run_set(root: Path, name: str, rebuild: bool) -> tuple[str, str, str, float]:
    """Build and test one set; returns (versions, subset, result, seconds)."""
    t0 = time.monotonic()
    with open(root / f"{name}.log", "w") as log:
        try:
            venv = build(root, name, rebuild, log)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            return "-", "-", f"build failed: {exc}", time.monotonic() - t0
        env = dict(os.environ, DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=str(venv / "torch_extensions"),
                   PATH=f"{venv / 'bin'}:{os.environ['PATH']}")
        py = str(venv / "bin" / "python")
        subset = SETS[name][1]
        if any("deepspeed" in t for t in subset):
            _run([py, "-m", "robust_plugins.cli.main", "prebuild"], log, env=env, timeout=900)
        rc = _run([py, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "--basetemp", str(venv / "tmp"),
                   *COMMON, *subset], log, env=env)
    tail = (root / f"{name}.log").read_text(errors="replace").splitlines()
    summary = next((x.strip("= ") for x in reversed(tail) if " passed" in x or " failed" in x or " error" in x),
                   f"exit {rc}")
    return versions(venv), " ".join(Path(t).stem for t in subset), ("PASS: " if rc == 0 else "FAIL: ") + summary, \
        time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    """Run the named sets (all by default); print and write the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sets", nargs="*", metavar="SET",
                        help=f"host sets to run (default: all): {', '.join(SETS)}")
    parser.add_argument("--root", default="/work/compat-venvs", help="where the venvs live (outside the repo)")
    parser.add_argument("--rebuild", action="store_true", help="build the venvs again")
    parser.add_argument("--out", default=None, help="the table's file (default <root>/compat.md)")
    args = parser.parse_args(argv)
    unknown = [s for s in args.sets if s not in SETS]
    if unknown:
        parser.error(f"unknown set(s) {unknown}; known: {', '.join(SETS)}")
    root = Path(args.root).resolve()
    if root == REPO or REPO in root.parents:
        parser.error(f"--root {root} is inside the repository; give a folder outside it")
    root.mkdir(parents=True, exist_ok=True)
    rows = ["| host set | versions | subset | result | s |", "|---|---|---|---|---|"]
    failed = False
    for name in args.sets or list(SETS):
        got, subset, result, secs = run_set(root, name, args.rebuild)
        failed |= not result.startswith("PASS")
        rows.append(f"| {name} | {got} | {subset} | {result} | {secs:.0f} |")
        print(rows[-1], flush=True)
    Path(args.out or root / "compat.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
