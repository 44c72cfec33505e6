"""A small decoder-only transformer (GPT) over bytes, in plain PyTorch.

No dropout and a seeded init, so two runs with the same seed and data are bitwise identical on CPU:
the property the plugin's ``codec: none`` path and checkpoint resumption are tested against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from robust_plugins.errors import ConfigError


@dataclass(frozen=True)
class GPTConfig:
    """Model shape. The vocabulary is the 256 byte values."""

    n_layer: int = 2
    """Transformer blocks."""

    n_head: int = 2
    """Attention heads; must divide ``d_model``."""

    d_model: int = 64
    """Residual stream width."""

    seq_len: int = 64
    """Context length in bytes (the position table's size)."""

    vocab_size: int = 256
    """Byte vocabulary; only change it for synthetic tests."""

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "d_model", "seq_len", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"GPTConfig.{name} must be a positive integer, got {value!r}.")
        if self.d_model % self.n_head:
            raise ConfigError(
                f"GPTConfig.d_model ({self.d_model}) must be divisible by n_head ({self.n_head})."
            )


#: ``tiny``: ~0.1M parameters, for tests (200 steps on 2 CPU ranks in well under 20 s of training).
#: ``small``: ~0.8M parameters, for the demo and benchmarks (large enough that gradient bytes, not
#: per-call latency, dominate the all-reduce; small enough for 4 ranks on 2 cores).
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=2, n_head=2, d_model=64, seq_len=64),
    "small": GPTConfig(n_layer=4, n_head=4, d_model=128, seq_len=128),
}


class _Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.fc_out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, c))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Byte-level GPT: token + position embeddings, pre-LayerNorm blocks, untied output head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2 style: N(0, 0.02), residual output projections scaled by 1/sqrt(2 * n_layer) so the
        # residual stream's variance does not grow with depth. The small head makes the initial
        # logits near zero, i.e. loss ~ ln(256) = 5.545.
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, p in self.named_parameters():
            if p.dim() == 1:
                if name.endswith("bias"):
                    nn.init.zeros_(p)
                continue  # LayerNorm weights stay 1
            std = resid_std if name.endswith(("proj.weight", "fc_out.weight")) else 0.02
            nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, T, vocab]`` when ``targets`` is None, else the mean cross-entropy loss."""
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ConfigError(f"Input length {t} exceeds the model's seq_len {self.cfg.seq_len}.")
        pos = torch.arange(t, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def resolve_config(preset: str | GPTConfig, **overrides: int) -> GPTConfig:
    """A preset name (``tiny``, ``small``) or a config, with optional field overrides."""
    if isinstance(preset, GPTConfig):
        base = preset
    else:
        if preset not in PRESETS:
            raise ConfigError(f"Unknown GPT preset {preset!r}; choose one of {', '.join(PRESETS)}.")
        base = PRESETS[preset]
    if not overrides:
        return base
    return GPTConfig(**{**base.__dict__, **overrides})


def build_gpt(preset: str | GPTConfig, seed: int, **overrides: int) -> GPT:
    """Build a GPT whose weights depend only on ``seed`` (and the shape)."""
    cfg = resolve_config(preset, **overrides)
    torch.manual_seed(seed)
    return GPT(cfg)
