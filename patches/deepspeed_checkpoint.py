"""DeepSpeed: the checkpoint bindings (``save_checkpoint``, ``load_checkpoint``, ``persist_every``'s ``step``).

``save_checkpoint`` / ``load_checkpoint`` are shadowed to store each rank's error-feedback
residuals beside DeepSpeed's files (residuals are training state).

With the ``checkpoint`` sub-block, the same two methods also make every save verified and atomic
(``robust_plugins/checkpoint``): DeepSpeed is handed the tag ``.tmp-<tag>``, so its
``_save_checkpoint`` / ``_save_zero_checkpoint`` write every rank's files into that temporary
directory, with ``save_latest=False`` so it never writes ``latest`` itself. While it runs, the
engine's ``checkpoint_engine.save`` is shadowed to fsync each file and catch a failed write (so
that every rank still reaches DeepSpeed's closing barrier), and ``_copy_recovery_script`` to catch
rank 0's copy of ``zero_to_fp32.py``. Then each rank hashes its files, rank 0 writes the manifest,
renames the directory to ``<tag>`` and only then rewrites ``latest``. ``load_checkpoint`` with no
tag picks the newest checkpoint that verifies (rank 0 decides, every rank loads the same tag).

Loading runs no code from the files. DeepSpeed 0.19's ``TorchCheckpointEngine.load`` calls
``torch.load(weights_only=False)``; every file DeepSpeed reads for a ZeRO 0-2, non-MoE,
non-universal checkpoint goes through ``engine.checkpoint_engine.load`` (``SDLoaderFactory``
for model states, ``_get_all_zero_checkpoint_state_dicts`` for ZeRO shards, the optimizer file
for ZeRO 0), so during a load that method is shadowed with ``torch.load(weights_only=True)`` and an
allowlist of four inert DeepSpeed types its files hold (``SAFE_GLOBALS``). A resharded load
(another data-parallel size) converts with ``ds_to_universal`` and loads the result through
``patches/deepspeed_universal.py``, whose reads are made the same safe load. Engines whose loads
take other paths (MoE, universal checkpoints, other checkpoint engines) are refused.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import TYPE_CHECKING

import torch

from robust_plugins._logging import current_rank, get_logger, warn_once
from robust_plugins.checkpoint import rollback_bound
from robust_plugins.errors import CheckpointError
from robust_plugins.patches import deepspeed_universal as _universal

if TYPE_CHECKING:
    from robust_plugins.patches.deepspeed import DeepSpeedPlugin

# The installer's logger: every line of the DeepSpeed patch logs under one name.
log = get_logger("robust_plugins.patches.deepspeed")

#: File each rank writes into ``<save_dir>/<tag>/`` next to DeepSpeed's own files.
STATE_FILE = "robust_plugins_rank{rank:05d}.pt"

#: Key added to a DeepSpeed client_state (with memory snapshots) listing the caller's own keys.
CLIENT_KEYS = "robust_plugins_client_keys"


def _state_path(ckpt_dir: str, tag: str) -> str:
    return os.path.join(ckpt_dir, str(tag), STATE_FILE.format(rank=current_rank()))


def _save_checkpoint(engine, plugin: DeepSpeedPlugin):
    original = engine.save_checkpoint

    def save_checkpoint(save_dir=None, tag=None, client_state={}, save_latest=True, exclude_frozen_parameters=False):
        if tag is None:
            tag = f"global_step{engine.global_steps}"  # DeepSpeed's own default tag
        if plugin.memory is not None:
            plugin.memory.note_client_state(client_state)
            # Which keys are the caller's: a disk load returns them mixed with DeepSpeed's own, and
            # the snapshots taken after it must carry only the caller's (as from memory).
            client_state = {**(client_state or {}), CLIENT_KEYS: sorted(client_state or {})}
        if plugin.disk is not None:
            return _verified_save(engine, plugin, original, _checkpoint_dir(plugin, save_dir, "save_checkpoint"),
                                  str(tag), client_state, save_latest, exclude_frozen_parameters)
        if plugin.has_state:
            path = _state_path(save_dir, tag)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            # Written before DeepSpeed's files so that DeepSpeed's `latest` (written last) never
            # points at a checkpoint whose residuals are missing; tmp + rename keeps it atomic.
            tmp = f"{path}.tmp"
            torch.save(plugin.state_dict(), tmp)
            os.replace(tmp, path)
        return original(save_dir, tag, client_state=client_state, save_latest=save_latest,
                        exclude_frozen_parameters=exclude_frozen_parameters)

    return save_checkpoint


def _checkpoint_dir(plugin: DeepSpeedPlugin, given, method: str) -> str:
    """The directory argument, or ``checkpoint.dir`` when the caller passed none."""
    if given:
        return os.fspath(given)
    if plugin.config.checkpoint.dir is None:
        raise CheckpointError(
            f"engine.{method}() was called without a directory and robust_plugins.checkpoint.dir is "
            f"not set: pass the directory or set checkpoint.dir in the config."
        )
    return plugin.config.checkpoint.dir


def _verified_save(engine, plugin, original, save_dir, tag, client_state, save_latest, exclude_frozen):
    """One atomic, hashed save (module docstring): DeepSpeed writes into ``.tmp-<tag>``."""
    disk = plugin.disk
    staging = disk.begin(save_dir, tag)
    ckpt_engine = engine.checkpoint_engine
    write, copy_scripts = ckpt_engine.save, engine._copy_recovery_script

    def save(state_dict, path):
        if disk.failed:  # this rank's save is lost already: do not fill the disk further
            return
        try:
            write(state_dict, path)
            disk.record(path)
        except Exception as exc:  # noqa: BLE001 - reported to every rank by disk.finish
            disk.fail(exc, path)

    def copy_recovery_script(save_path):
        try:
            copy_scripts(save_path)
        except OSError as exc:
            disk.fail(exc)

    ckpt_engine.save = save
    engine._copy_recovery_script = copy_recovery_script
    try:
        # DeepSpeed's tag-consistency check and barriers run as usual, on the temporary name.
        original(save_dir, os.path.basename(staging), client_state=client_state, save_latest=False,
                 exclude_frozen_parameters=exclude_frozen)
        if plugin.has_state:
            save(plugin.state_dict(), os.path.join(staging, STATE_FILE.format(rank=current_rank())))
    except Exception as exc:
        # Raised outside the two shadowed writes: the other ranks may be waiting in one of
        # DeepSpeed's barriers, bounded only by the process-group timeout.
        raise CheckpointError(
            f"Checkpoint save of {tag!r} into {save_dir} failed inside DeepSpeed on rank {current_rank()} "
            f"({type(exc).__name__}: {exc}); nothing was committed, {staging} is left for the next save "
            f"to remove."
        ) from exc
    finally:
        del ckpt_engine.save
        del engine._copy_recovery_script
    disk.finish(save_dir, tag, engine.global_steps, save_latest)
    return True


@contextlib.contextmanager
def _weights_only_loads(engine):
    """Route DeepSpeed's loads through ``torch.load(weights_only=True)`` for one load_checkpoint."""
    ckpt_engine = engine.checkpoint_engine
    ckpt_engine.load = _universal.safe_load
    try:
        yield
    finally:
        del ckpt_engine.load


def _load_checkpoint(engine, plugin: DeepSpeedPlugin):
    original = engine.load_checkpoint

    def load_checkpoint(load_dir=None, tag=None, *args, **kwargs):
        t0 = time.perf_counter()
        reshard = None
        # After a rollback (robust run), nothing newer than its last good step may load, from
        # memory or disk: a disk save of a later step can exist (ok_to_save timed out under load).
        bound = rollback_bound() if tag is None else None
        if plugin.memory is not None and tag is None:
            # Restore order: own memory snapshot -> a peer's copy -> newest verified disk -> older.
            if not load_dir and plugin.config.checkpoint.dir is None:
                found = plugin.memory.restore(disk_step=None)
                return ((f"memory://step{found[0]}/{found[1]}", plugin.memory.restored_client_state())
                        if found else (None, None))
            load_dir = _checkpoint_dir(plugin, load_dir, "load_checkpoint")
            found = plugin.memory.restore(disk_step=_newest_disk_step(load_dir, bound))
            if found is not None:
                # No path on disk: the string says the step and where the state came from.
                return f"memory://step{found[0]}/{found[1]}", plugin.memory.restored_client_state()
        if plugin.disk is not None:
            load_dir = _checkpoint_dir(plugin, load_dir, "load_checkpoint")
            tag = plugin.disk.select(load_dir, tag, max_step=bound)
            if tag is None:
                return None, None  # an empty directory: a fresh start, as DeepSpeed reports it
            from robust_plugins.checkpoint.persist import is_snapshot_checkpoint

            reshard = _plan_reshard(engine, load_dir, tag)
            if is_snapshot_checkpoint(load_dir, tag):
                # Written by the background saver (memory_every + persist_every): no DeepSpeed files.
                if reshard is not None:
                    raise CheckpointError(
                        f"{load_dir}/{tag} was written by robust_plugins' background saver at another "
                        f"data-parallel size ({reshard.message}); those per-rank snapshots cannot be "
                        f"resharded. Resume at the saved size, or reshard from a checkpoint written by "
                        f"engine.save_checkpoint (DeepSpeed format).")
                if plugin.memory is None:
                    raise CheckpointError(
                        f"{load_dir}/{tag} was written by robust_plugins' background saver "
                        f"(checkpoint.memory_every with persist_every); loading it needs memory_every "
                        f"in this job's checkpoint block too.")
                plugin.memory.load_from_disk(load_dir, tag)
                from robust_plugins.patches.deepspeed_memory import record_restore

                record_restore(engine.global_steps, f"disk:{tag}", time.perf_counter() - t0)
                return os.path.join(load_dir, tag), plugin.memory.restored_client_state()
            if reshard is None:
                with _weights_only_loads(engine):
                    load_path, client_state = original(load_dir, tag, *args, **kwargs)
            else:
                load_path, client_state = _load_resharded(engine, plugin, original, load_dir, tag, reshard,
                                                          args, kwargs)
            if load_path is None:
                raise CheckpointError(
                    f"DeepSpeed found no model files in the verified checkpoint {load_dir}/{tag}; "
                    f"it was saved by another kind of engine (e.g. other model parallelism)."
                )
        else:
            load_path, client_state = original(load_dir, tag, *args, **kwargs)
            if load_path is None:
                return load_path, client_state
            if tag is None:
                latest = "latest_universal" if engine.load_universal_checkpoint() else "latest"
                with open(os.path.join(load_dir, latest)) as f:
                    tag = f.read().strip()
        if isinstance(client_state, dict) and CLIENT_KEYS in client_state:
            client_state = dict(client_state)
            keys = client_state.pop(CLIENT_KEYS)
            if plugin.memory is not None:
                plugin.memory.client_state = {"step": engine.global_steps,
                                              "state": {k: client_state[k] for k in keys if k in client_state}}
        if plugin.has_state:
            if plugin.disk is not None and reshard is not None:
                # Residuals are each rank's error of its own share of the old partition: no rank of
                # the new layout owns them.
                log.warning("robust_plugins: compression residuals start from zero after resharding "
                            "(they belong to the old data-parallel layout)")
            else:
                _load_residuals(plugin, load_dir, tag)
        if plugin.memory is not None:
            from robust_plugins.patches.deepspeed_memory import record_restore

            plugin.memory.taken_at = engine.global_steps
            record_restore(engine.global_steps, f"disk:{tag}", time.perf_counter() - t0)
        return load_path, client_state

    return load_checkpoint


def _plan_reshard(engine, load_dir: str, tag: str):
    """The elastic plan for a selected checkpoint (``checkpoint/elastic.py``), or None."""
    from robust_plugins.checkpoint import manifest as mf
    from robust_plugins.checkpoint.elastic import plan_reshard
    from deepspeed import comm as dist

    m = mf.read_manifest(os.path.join(load_dir, tag))
    saved = {"where": f"checkpoint {os.path.join(load_dir, tag)}", "world_size": m.world_size, **m.layout}
    now = {"world_size": dist.get_world_size(), "dp_world_size": engine.dp_world_size,
           "zero_stage": engine.zero_optimization_stage(), "micro_batch": engine.train_micro_batch_size_per_gpu()}
    return plan_reshard(saved, now)


def _load_resharded(engine, plugin, original, load_dir: str, tag: str, reshard, args, kwargs):
    """Load a checkpoint of another data-parallel size and keep its global batch.

    ZeRO 0 (``direct``): model and optimizer state are replicated and live in the one
    ``mp_rank_00_model_states.pt``, which DeepSpeed loads at any DP size. ZeRO 1-3 (``universal``):
    rank 0 converts the verified checkpoint with DeepSpeed's ``ds_to_universal`` into
    ``<dir>/.universal/<tag>`` (every file the converter reads, and every converted file the
    load reads, goes through ``torch.load(weights_only=True)``), every rank loads it with DeepSpeed's
    ``load_universal`` path, then the converted copy is removed.
    """
    from robust_plugins.checkpoint import coord
    from robust_plugins.checkpoint.elastic import DIRECT

    if engine.global_rank == 0:
        log.warning("robust_plugins: %s", reshard.message)
    timeout_s = plugin.config.checkpoint.timeout_s
    if reshard.method == DIRECT:
        with _weights_only_loads(engine):
            load_path, client_state = original(load_dir, tag, *args, **kwargs)
    else:
        univ_root = os.path.join(load_dir, ".universal")
        result = {}
        if engine.global_rank == 0:
            try:
                _convert_to_universal(os.path.join(load_dir, tag), univ_root, tag, timeout_s)
            except CheckpointError as exc:
                result = {"error": str(exc)}
        result = coord.broadcast_json(result, timeout_s, f"resharding {load_dir}/{tag}: converting",
                                      device=engine.device)
        if result.get("error"):
            raise CheckpointError(result["error"])
        engine._config.load_universal_checkpoint = True
        try:
            with _weights_only_loads(engine), _universal.safe_universal_loads():
                load_path, client_state = original(univ_root, tag, *args, **kwargs)
        finally:
            engine._config.load_universal_checkpoint = False
            coord.broadcast_json({}, timeout_s, f"resharding {load_dir}/{tag}: loaded", device=engine.device)
            if engine.global_rank == 0:
                import shutil

                shutil.rmtree(univ_root, ignore_errors=True)
        if load_path is not None:  # name the verified checkpoint, not the removed converted copy
            load_path = os.path.join(load_dir, tag, os.path.relpath(load_path, os.path.join(univ_root, tag)))
    engine.set_train_batch_size(reshard.train_batch_size)
    return load_path, client_state


def _convert_to_universal(src: str, univ_root: str, tag: str, timeout_s: float) -> None:
    """Run DeepSpeed's converter on a verified checkpoint directory: a bounded child process in
    which every ``torch.load`` is ``weights_only=True`` with the allowlist (``deepspeed_universal``)."""
    import shutil
    import subprocess
    import sys

    out = os.path.join(univ_root, tag)
    shutil.rmtree(univ_root, ignore_errors=True)
    cmd = [sys.executable, "-m", _universal.__name__, "--input_folder", src,
           "--output_folder", out, "--num_extract_workers", "1", "--num_merge_workers", "1",
           # Plain DeepSpeed engines do not write Megatron-DeepSpeed's universal_checkpoint_info.
           "--inject_missing_state"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        shutil.rmtree(univ_root, ignore_errors=True)
        raise CheckpointError(f"Converting {src} to a universal checkpoint took over {timeout_s:.0f} s "
                              f"(checkpoint.timeout_s); it was stopped and nothing was loaded.") from exc
    if proc.returncode != 0:
        shutil.rmtree(univ_root, ignore_errors=True)
        refused = [ln for ln in proc.stderr.splitlines() if ln.startswith("robust_plugins: ")]
        if refused:
            raise CheckpointError(f"{refused[-1][len('robust_plugins: '):]} Nothing was converted or loaded.")
        tail = " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-3:])
        raise CheckpointError(f"DeepSpeed's ds_to_universal failed on {src} (exit {proc.returncode}: {tail}); "
                              f"nothing was loaded. Resume at the saved data-parallel size instead.")


def _newest_disk_step(root: str, max_step: int | None = None) -> int | None:
    """Step of the newest committed checkpoint in ``root`` (manifest only, not verified), not
    after ``max_step``."""
    from robust_plugins.checkpoint import scan

    steps = [e.manifest.step for e in scan(root)
             if e.manifest is not None and (max_step is None or e.manifest.step <= max_step)]
    return max(steps, default=None)


def _load_residuals(plugin: DeepSpeedPlugin, load_dir: str, tag: str) -> None:
    path = _state_path(load_dir, tag)
    if not os.path.isfile(path):
        warn_once(
            log, f"missing:{path}",
            "robust_plugins: checkpoint %s/%s has no plugin state for rank %d (%s missing: "
            "saved without the plugin or at another world size). Error-feedback residuals "
            "start from zero; the run continues, but not bitwise as an uninterrupted one.",
            load_dir, tag, current_rank(), os.path.basename(path),
        )
        return
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(
            f"robust_plugins state {path} cannot be read ({exc}); it is corrupt or truncated. "
            f"Load an older checkpoint tag or delete the file to restart residuals from zero."
        ) from exc
    plugin.load_state_dict(sd)


def _step_with_persist(engine, plugin: DeepSpeedPlugin):
    original = engine.step
    persist = _persist_observer(plugin)

    def step(lr_kwargs=None):
        result = original(lr_kwargs)
        persist(engine)
        return result

    return step


def _persist_observer(plugin: DeepSpeedPlugin):
    """After an optimizer step: ``checkpoint.persist_every``'s save, when it is due (a step
    observer for pipeline engines, whose ``step()`` is never called)."""
    every = plugin.config.checkpoint.persist_every

    def persist(engine) -> None:
        # global_steps moves only at gradient-accumulation boundaries; save once per such step.
        # With memory snapshots the snapshot thread writes these saves in the background.
        n = engine.global_steps
        background = plugin.memory is not None and plugin.memory.persister is not None
        if every and not background and n % every == 0 and n != plugin.persisted_at:
            plugin.persisted_at = n
            engine.save_checkpoint(plugin.config.checkpoint.dir)

    return persist
