"""Run Megatron-LM's own training scripts (``pretrain_gpt.py``...) with the robust_plugins block.

::

    robust run --nproc-per-node 8 -m robust_plugins.megatron_lm --robust-config block.json \\
        /path/to/Megatron-LM/pretrain_gpt.py <Megatron-LM arguments>

(``torchrun`` in place of ``robust run`` works too, without the watchdog and restarts.) The block
is the ``robust_plugins`` JSON object (or a file holding ``{"robust_plugins": {...}}``), named by
``--robust-config`` or the ``ROBUST_PLUGINS_CONFIG`` environment variable. The entry installs the
hooks of :mod:`robust_plugins.patches.megatron_lm` (and, where CUDA is not available, the CPU
redirects of :mod:`robust_plugins.patches.megatron_lm_cpu`), then runs the script as
``__main__`` with ``runpy``: Megatron-LM itself is not edited.

Version guard: the checkout's Megatron-LM version is the one in its
``megatron/core/package_info.py`` (Megatron-LM tags its releases ``core_v<that version>``); it
must be one of :data:`CHECKED` and equal the installed megatron-core, which the script uses.
"""

from __future__ import annotations

import ast
import os
import runpy
import sys
from typing import Any, Mapping, Sequence

from robust_plugins._logging import announce, get_logger
from robust_plugins.errors import ConfigError, HostVersionError
from robust_plugins.schema.common import BLOCK_KEY, load_json

log = get_logger(__name__)

#: Megatron-LM versions (tag ``core_v<version>``) whose loop the hooks were checked against.
CHECKED = ("0.16.1",)

ENV_CONFIG = "ROBUST_PLUGINS_CONFIG"

USAGE = ("usage: python -m robust_plugins.megatron_lm [--robust-config FILE] SCRIPT [SCRIPT ARGS...]\n"
         "  FILE: JSON, the robust_plugins block or {\"robust_plugins\": {...}} (default: $ROBUST_PLUGINS_CONFIG)\n"
         "  SCRIPT: Megatron-LM's pretrain_gpt.py (or another script that calls megatron.training.pretrain)")


def parse_argv(argv: Sequence[str]) -> tuple[str | None, str, list[str]]:
    """``[--robust-config FILE] SCRIPT ARGS...`` -> (config path or None, script, script args).

    The entry's own option comes before the script; everything after the script is the script's.
    """
    args = list(argv)
    config = None
    while args and args[0].startswith("--robust-config"):
        opt = args.pop(0)
        if "=" in opt:
            config = opt.split("=", 1)[1]
        elif args:
            config = args.pop(0)
        else:
            raise ConfigError(f"--robust-config needs a file name.\n{USAGE}")
        if not config:
            raise ConfigError(f"--robust-config needs a file name, got an empty one.\n{USAGE}")
    if not args or args[0].startswith("-"):
        got = args[0] if args else "nothing"
        raise ConfigError(f"robust_plugins.megatron_lm: expected the training script (pretrain_gpt.py) after the "
                          f"entry's options, got {got}.\n{USAGE}")
    return config, args[0], args[1:]


def load_block(path: str | None, environ: Mapping[str, str] = os.environ) -> dict[str, Any] | None:
    """The ``robust_plugins`` block from ``path`` (or ``$ROBUST_PLUGINS_CONFIG``); None if neither."""
    path = path or environ.get(ENV_CONFIG) or None
    if path is None:
        return None
    if not os.path.isfile(path):
        raise ConfigError(f"robust_plugins.megatron_lm: the config file {path!r} does not exist (from "
                          f"{'--robust-config' if path != environ.get(ENV_CONFIG) else ENV_CONFIG}); "
                          f"give a JSON file holding the {BLOCK_KEY} block.")
    data = load_json(path)
    if not isinstance(data, Mapping):
        raise ConfigError(f"robust_plugins.megatron_lm: {path} holds a JSON {type(data).__name__}; expected an "
                          f"object: the {BLOCK_KEY} block, or {{\"{BLOCK_KEY}\": {{...}}}}.")
    block = data[BLOCK_KEY] if BLOCK_KEY in data else data
    if not isinstance(block, Mapping):
        raise ConfigError(f"robust_plugins.megatron_lm: {path}: {BLOCK_KEY} must be a JSON object, got "
                          f"{type(block).__name__}.")
    return dict(block)


def argv_flags(script_args: Sequence[str]) -> dict[str, Any]:
    """The Megatron-LM options the hooks refuse, as seen on the command line (``--x v`` and
    ``--x=v``): ``enable_ft_package`` and ``non_persistent_ckpt_type``."""
    out: dict[str, Any] = {"enable_ft_package": False, "non_persistent_ckpt_type": None}
    for i, arg in enumerate(script_args):
        name, _, value = arg.partition("=")
        if name == "--enable-ft-package":
            out["enable_ft_package"] = True
        elif name == "--non-persistent-ckpt-type":
            out["non_persistent_ckpt_type"] = value or (script_args[i + 1] if i + 1 < len(script_args) else None)
    return out


def checkout_version(script: str) -> str:
    """Megatron-LM's version from ``<script's folder>/megatron/core/package_info.py``."""
    path = os.path.join(os.path.dirname(os.path.abspath(script)), "megatron", "core", "package_info.py")
    if not os.path.isfile(path):
        raise HostVersionError(f"robust_plugins.megatron_lm: {script} is not in a Megatron-LM checkout ({path} "
                               f"is missing); run the script from the checkout's root folder "
                               f"(git clone -b core_v{CHECKED[-1]} https://github.com/NVIDIA/Megatron-LM).")
    values: dict[str, Any] = {}
    for node in ast.parse(open(path, encoding="utf-8").read()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("MAJOR", "MINOR", "PATCH", "PRE_RELEASE"):
                values[node.targets[0].id] = ast.literal_eval(node.value)
    try:
        return f"{values['MAJOR']}.{values['MINOR']}.{values['PATCH']}{values.get('PRE_RELEASE', '')}"
    except KeyError as exc:
        raise HostVersionError(f"robust_plugins.megatron_lm: {path} has no {exc.args[0]}; cannot tell the "
                               f"Megatron-LM version (checked: {', '.join(CHECKED)}).") from None


def check_versions(checkout: str, installed: str) -> None:
    """Refuse a Megatron-LM not in :data:`CHECKED`, or one whose megatron-core differs from the installed."""
    if checkout not in CHECKED:
        raise HostVersionError(
            f"robust_plugins.megatron_lm: Megatron-LM {checkout} (its megatron/core/package_info.py) is not one "
            f"robust_plugins was checked against ({', '.join('core_v' + v for v in CHECKED)}); check out one of "
            f"those tags.")
    if checkout != installed:
        raise HostVersionError(
            f"robust_plugins.megatron_lm: the Megatron-LM checkout is {checkout} but the installed megatron-core "
            f"is {installed}; the script runs on the installed one: pip install 'megatron-core=={checkout}'.")


def main(argv: Sequence[str] | None = None) -> None:
    """The ``python -m robust_plugins.megatron_lm`` entry (see the module docstring)."""
    from robust_plugins.patches import megatron_lm

    config, script, script_args = parse_argv(sys.argv[1:] if argv is None else argv)
    block = load_block(config)
    refusal = megatron_lm.ft_refusal(argv_flags(script_args))
    if refusal is not None:
        raise ConfigError(refusal)
    if not os.path.isfile(script):
        raise ConfigError(f"robust_plugins.megatron_lm: the script {script!r} does not exist.\n{USAGE}")
    installed = megatron_lm.installed_megatron_core()  # imports the installed megatron.core first
    check_versions(checkout_version(script), installed)
    # As `python script.py` does (gpt_builders, model_provider, megatron.training); megatron.core
    # stays the installed one, already imported, with its prebuilt dataset helper.
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    megatron_lm.install(block, cpu=not megatron_lm.cuda_available())
    sys.argv = [script, *script_args]
    announce(log, "robust_plugins: running %s under robust_plugins.megatron_lm (Megatron-LM %s)",
             os.path.basename(script), installed)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
