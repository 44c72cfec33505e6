"""Per-job compression settings and the error-feedback residuals that go into checkpoints."""

from __future__ import annotations

from typing import Any, Hashable

import torch

from robust_plugins.config import CompressionConfig
from robust_plugins.errors import CheckpointError, ConfigError, RobustPluginsError

#: Bumped when the layout of :meth:`CompressionState.state_dict` changes.
STATE_DICT_VERSION = 1


def _check_key(key: Any, whole: Any = None) -> None:
    whole = key if whole is None else whole
    if isinstance(key, tuple):
        for part in key:
            _check_key(part, whole)
    elif isinstance(key, bool) or not isinstance(key, (str, int)):
        raise RobustPluginsError(
            f"Bucket key {whole!r} is not allowed: use a str, an int or a tuple of those (e.g. "
            f"('ddp', 3)), so that the key is the same in every process and after a checkpoint."
        )


def key_to_str(key: Hashable) -> str:
    """Canonical string form of a bucket key, as stored in :meth:`CompressionState.state_dict`.

    ``repr`` of str / int / tuple values is deterministic across processes and keeps ``"3"``,
    ``3`` and ``("3",)`` distinct.
    """
    _check_key(key)
    return repr(key)


class CompressionState:
    """Compression settings plus the error-feedback residuals of every bucket.

    Two residuals exist per bucket key: the sender's (fp32, the whole bucket) and the reducing
    side's (fp32, the chunk this rank reduces in a two-phase all-reduce). Both are training state:
    save :meth:`state_dict` with the model checkpoint.

    Args:
        codec: ``none``, ``bf16``, ``int8``, ``int4`` or ``sign``.
        block_size: elements per fp32 scale, a power of two in [32, 4096].
        error_feedback: keep and apply residuals.
        min_numel: buckets with fewer elements go through the uncompressed collective.
        process_group: the group the DDP comm hook reduces over (``None``: the default group).
            Not part of the state dict.

    The arguments are validated by :class:`~robust_plugins.config.CompressionConfig`, so errors
    read as they do for a config file.
    """

    def __init__(
        self,
        codec: str = "int8",
        block_size: int = 256,
        error_feedback: bool = True,
        min_numel: int = 0,
        *,
        process_group: Any = None,
    ):
        if codec == "auto":
            raise ConfigError(
                "CompressionState needs a fixed codec (none, bf16, int8, int4, sign): codec 'auto' is decided "
                "per bucket by robust_plugins.comm.gradient_sync.GradientSync (the DeepSpeed integration), "
                "which keeps one CompressionState per candidate codec."
            )
        self.config = CompressionConfig(
            codec=codec, block_size=block_size, error_feedback=error_feedback, min_numel=min_numel
        )
        self.process_group = process_group
        self._sender: dict[str, torch.Tensor] = {}
        self._server: dict[str, torch.Tensor] = {}

    @classmethod
    def from_config(cls, cfg: CompressionConfig, *, process_group: Any = None) -> "CompressionState":
        """Build from the validated ``compression`` sub-block (``warmup_steps`` is the caller's)."""
        if not isinstance(cfg, CompressionConfig):
            raise TypeError(f"from_config needs a CompressionConfig, got {type(cfg).__name__}.")
        return cls(
            codec=cfg.codec,
            block_size=cfg.block_size,
            error_feedback=cfg.error_feedback,
            min_numel=cfg.min_numel,
            process_group=process_group,
        )

    @property
    def codec(self) -> str:
        """The wire format."""
        return self.config.codec

    @property
    def block_size(self) -> int:
        """Elements per scale."""
        return self.config.block_size

    @property
    def error_feedback(self) -> bool:
        """Whether residuals are kept."""
        return self.config.error_feedback

    @property
    def min_numel(self) -> int:
        """Smallest bucket that is compressed."""
        return self.config.min_numel

    def __repr__(self) -> str:
        return f"CompressionState({self.config.describe()}, buckets={len(self._sender)})"

    # -- residuals -------------------------------------------------------------------------------
    def _get(
        self, table: dict[str, torch.Tensor], side: str, key: Hashable, numel: int, device: torch.device
    ) -> torch.Tensor:
        skey = key_to_str(key)
        buf = table.get(skey)
        if buf is None:
            buf = table[skey] = torch.zeros(numel, dtype=torch.float32, device=device)
        elif buf.numel() != numel:
            raise RobustPluginsError(
                f"Bucket key {key!r} had a {side} residual of {buf.numel()} elements and now has "
                f"{numel}: a key must always name the same gradient slice (same size, and for the "
                f"reducing side the same world size). Use a new key or call forget({key!r})."
            )
        elif buf.device != torch.device(device):
            # A loaded checkpoint lands on the CPU; move it once to where the gradients live.
            buf = table[skey] = buf.to(device)
        return buf

    def sender_residual(self, key: Hashable, numel: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The sending side's fp32 residual for ``key`` (``numel`` elements), created as zeros."""
        return self._get(self._sender, "sender", key, numel, torch.device(device))

    def server_residual(self, key: Hashable, numel: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The reducing side's fp32 residual for ``key`` (this rank's chunk), created as zeros."""
        return self._get(self._server, "reducing-side", key, numel, torch.device(device))

    def residual_numel(self, key: Hashable) -> int | None:
        """Size of the sender residual stored for ``key``, or ``None`` if there is none."""
        buf = self._sender.get(key_to_str(key))
        return None if buf is None else buf.numel()

    def forget(self, key: Hashable) -> None:
        """Drop both residuals of ``key`` (e.g. after the host re-bucketed its gradients)."""
        skey = key_to_str(key)
        self._sender.pop(skey, None)
        self._server.pop(skey, None)

    def residual_sq_norm(self) -> float:
        """Squared L2 norm of every residual this rank holds (sender and server side), for
        telemetry: a residual that keeps growing means the codec is losing too much."""
        # Summed on each device first: one read of the host per device (a read per residual was
        # a host sync per bucket on a GPU).
        per_device: dict = {}
        for table in (self._sender, self._server):
            for buf in table.values():
                per_device.setdefault(buf.device, []).append(buf.float().pow(2).sum())
        return float(sum(float(torch.stack(parts).double().sum()) for parts in per_device.values()))

    def keys(self) -> list[str]:
        """String forms (:func:`key_to_str`) of every key holding a residual."""
        return sorted(set(self._sender) | set(self._server))

    # -- checkpointing ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Residuals and settings as plain tensors, ints and strings.

        Loadable with ``torch.load(..., weights_only=True)``. Keys are :func:`key_to_str` strings.
        """
        return {
            "version": STATE_DICT_VERSION,
            "codec": self.codec,
            "block_size": self.block_size,
            "error_feedback": int(self.error_feedback),
            "sender": dict(self._sender),
            "server": dict(self._server),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore residuals saved by :meth:`state_dict`; the codec and block size must match."""
        missing = [k for k in ("version", "codec", "block_size", "sender", "server") if k not in sd]
        if missing:
            raise CheckpointError(
                f"Compression state in the checkpoint lacks {', '.join(missing)}; it holds "
                f"{sorted(sd)}. Was it written by CompressionState.state_dict()?"
            )
        if sd["version"] != STATE_DICT_VERSION:
            raise CheckpointError(
                f"Compression state version {sd['version']} cannot be read; this robust_plugins "
                f"reads version {STATE_DICT_VERSION}."
            )
        if sd["codec"] != self.codec or sd["block_size"] != self.block_size:
            raise CheckpointError(
                f"Checkpoint residuals were made with codec={sd['codec']!r}, "
                f"block_size={sd['block_size']}, but this job runs codec={self.codec!r}, "
                f"block_size={self.block_size}. Run with the checkpoint's settings, or drop the "
                f"compression state to restart error feedback from zero."
            )
        for name in ("sender", "server"):
            for key, tensor in sd[name].items():
                if not isinstance(key, str) or not isinstance(tensor, torch.Tensor):
                    raise CheckpointError(
                        f"Compression state entry {name}[{key!r}] must map a string key to a "
                        f"tensor, got {type(key).__name__} -> {type(tensor).__name__}."
                    )
        self._sender = {k: v.detach().to(torch.float32).clone() for k, v in sd["sender"].items()}
        self._server = {k: v.detach().to(torch.float32).clone() for k, v in sd["server"].items()}


def residuals_sq_norm(states) -> float:
    """Squared L2 norm of the residuals of every :class:`CompressionState` in ``states`` (codec
    ``auto`` keeps one state a candidate): telemetry's residual figure. Takes the states, not the
    :class:`~robust_plugins.comm.GradientSync`, so a recorder holding it keeps no engine alive."""
    return sum(st.residual_sq_norm() for st in states)

