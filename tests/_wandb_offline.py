"""Read a W&B offline run back: the ``run-<id>.wandb`` transaction log, decoded with wandb's own
protobuf classes (``wandb.proto.wandb_internal_pb2.Record``).

wandb 0.31 has no Python reader for the file any more (its Go core writes it). The framing is
the LevelDB log format W&B has always used: a 7-byte header (``:W&B``, 0xBEE1 little-endian,
version 0), then 32 KiB blocks of chunks, each with a 7-byte header (CRC-32, length uint16 LE,
type: 1 full, 2 first, 3 middle, 4 last). This reader checks every CRC, so a torn file fails
loudly instead of yielding partial data.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

BLOCK = 32 * 1024
HEADER = b":W&B" + struct.pack("<H", 0xBEE1) + b"\x00"


def records(path: str | Path):
    """Yield every record of a ``.wandb`` file as ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    if not data.startswith(HEADER):
        raise ValueError(f"{path}: not a W&B transaction log (header {data[:7]!r})")
    pos, pending = len(HEADER), b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # block trailer padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        if zlib.crc32(bytes([kind]) + chunk) & 0xFFFFFFFF != crc:
            raise ValueError(f"{path}: CRC mismatch at byte {pos}")
        pos += 7 + length
        pending += chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(pending)
            pending = b""
            yield rec


def read_run(run_dir: str | Path) -> dict:
    """``{"project", "group", "name", "config": {...}, "history": [{...}, ...]}`` of one offline run
    directory (``.../wandb/offline-run-*``)."""
    files = list(Path(run_dir).glob("run-*.wandb"))
    if len(files) != 1:
        raise ValueError(f"{run_dir}: expected one run-*.wandb file, found {files}")
    out = {"config": {}, "history": []}
    for rec in records(files[0]):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out.update(project=rec.run.project, group=rec.run.run_group, name=rec.run.display_name)
            for item in rec.run.config.update:
                out["config"][item.key] = json.loads(item.value_json)
        elif kind == "config":
            for item in rec.config.update:
                out["config"][item.key] = json.loads(item.value_json)
        elif kind == "history":
            row = {}
            for item in rec.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            out["history"].append(row)
    return out
