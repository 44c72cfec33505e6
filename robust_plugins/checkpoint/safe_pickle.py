"""Check that a megatron-core ``dist_checkpointing`` directory can be read without running code.

``dist_checkpointing.load`` (torch_dist format) reads three kinds of files: ``*.distcp`` shards
(raw tensor storage; torch reads any pickled items in them with ``weights_only=True``),
``common.pt`` (megatron calls ``torch.load`` without ``weights_only``: safe only while torch's
default is True, as it is from torch 2.6 unless ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` is set) and
``.metadata``, which torch's ``FileSystemReader.read_metadata`` unpickles with plain
``pickle.load``: any global in it would be imported and called.

:func:`check_dist_checkpoint` reads ``.metadata`` with an unpickler that resolves only the
plain-data classes torch's checkpoint metadata consists of (:data:`METADATA_GLOBALS`, found by
recording every global of megatron-core 0.16 and plain torch 2.13 checkpoints) and ``common.pt`` with
``torch.load(weights_only=True)``; anything else raises :class:`CheckpointError` naming the
global, before megatron opens the directory. The files were verified against the manifest's
sha256 just before, so the bytes megatron then reads are the bytes checked here.
"""

from __future__ import annotations

import os
import pickle
import re

from robust_plugins.errors import CheckpointError

#: (module, name) pairs a torch.distributed.checkpoint ``.metadata`` pickle may name: dataclasses
#: and enums of plain fields, ``torch.Size``, and ``torch.serialization._get_layout`` (maps a
#: layout's name to the layout; torch's own weights_only unpickler allows it too). torch dtypes
#: (``torch.float32``...) are allowed by type below.
METADATA_GLOBALS = frozenset({
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    # StorageMeta.checkpoint_id of a plain torch save: a path, built from its string.
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    *(("torch.distributed.checkpoint.metadata", n) for n in (
        "BytesStorageMetadata", "ChunkStorageMetadata", "Metadata", "MetadataIndex", "StorageMeta",
        "TensorProperties", "TensorStorageMetadata", "_MEM_FORMAT_ENCODING")),
    *(("torch.distributed.checkpoint.planner", n) for n in (
        "SavePlan", "TensorWriteData", "WriteItem", "WriteItemType")),
})


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only :data:`METADATA_GLOBALS` and torch dtypes; refuses everything else."""

    def find_class(self, module: str, name: str):
        import torch

        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in METADATA_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")


def check_dist_checkpoint(directory: str | os.PathLike) -> None:
    """Raise CheckpointError if ``directory``'s ``.metadata`` or ``common.pt`` holds anything but data."""
    import torch

    meta = os.path.join(directory, ".metadata")
    if os.path.isfile(meta):
        try:
            with open(meta, "rb") as f:
                _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, AttributeError, EOFError, ValueError, TypeError) as exc:
            raise CheckpointError(
                f"{meta} holds more than torch's checkpoint metadata ({exc}); torch would unpickle it "
                f"with plain pickle.load, which can run code, so the checkpoint was not loaded. Load it "
                f"only if you trust it, with megatron-core's dist_checkpointing.load directly.") from exc
    common = os.path.join(directory, "common.pt")
    if os.path.isfile(common):
        try:
            torch.load(common, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            # torch's message ends in advice to allowlist the global; its name is the news.
            found = re.search(r"GLOBAL (\S+)", str(exc))
            what = f"the global {found.group(1)}" if found else str(exc).splitlines()[0]
            raise CheckpointError(
                f"{common} needs {what} to load, which is not tensors or plain data; it was not loaded "
                f"(robust_plugins reads checkpoints with torch.load(weights_only=True)).") from exc
