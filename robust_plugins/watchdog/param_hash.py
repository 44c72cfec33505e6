"""The parameter hash of the SDC check: the same bytes give the same 64 bits on every rank.

:func:`param_hash` is what the watchdog client (:mod:`robust_plugins.watchdog.client`) all-gathers
every ``sdc_every`` steps; a rank whose hash differs from the majority holds corrupted parameters.
"""

from __future__ import annotations

import hashlib

from robust_plugins.watchdog.protocol import MSG_HASH


def param_hash(params: list) -> int:
    """A 64-bit hash (signed, to fit an int64 tensor) of the parameters' bytes, in order.

    Host parameters: blake2b of their bytes. Device parameters (:func:`hashes_on_device`): the
    hash is computed where they are (:func:`device_hash`) and only its 8 bytes move; copying a
    model to the host every ``sdc_every`` steps would cost its whole size in PCIe traffic."""
    import torch

    if hashes_on_device(params):
        return device_hash(params)
    h = hashlib.blake2b(digest_size=8)
    for p in params:
        t = p.detach().contiguous().reshape(-1).view(torch.uint8)
        h.update(t.cpu().numpy().tobytes())
    return int.from_bytes(h.digest(), "little", signed=True)


def hashes_on_device(params: list) -> bool:
    """Whether :func:`param_hash` hashes on the parameters' device (pure): for non-CPU tensors."""
    return bool(params) and params[0].device.type != "cpu"


#: :func:`device_hash`: bytes a pass widens to int64 (64 MiB of temporaries per pass).
_HASH_CHUNK = 1 << 23
#: Odd multipliers (< 2**63, so they are int64 scalars) of the byte positions and the parameters.
_K_POS, _K_ADD, _K_PARAM = 0x2545F4914F6CDD1D, 0x1B873593, 0x5851F42D4C957F2D


def device_hash(params: list) -> int:
    """A 64-bit hash of the parameters' bytes computed with tensor ops on their own device.

    Each byte b at position i (over all parameters, in order) adds ``b * m(i)`` modulo 2**64,
    ``m(i)`` odd: a flipped bit changes b by 2**k (k < 8) and the sum by ``2**k * m(i)``, never
    0 modulo 2**64, so a single bit flip always changes the hash (the SDC check's case); each
    parameter's sum is folded in order, so the order counts too. Integer sums are exact and
    order-free, so every rank on the same device type gets the same value. Not blake2b: a CPU
    rank and a GPU rank of one job would disagree, which no supported job has.
    """
    import torch

    h = None
    pos = 0
    for p in params:
        flat = p.detach().contiguous().reshape(-1).view(torch.uint8)
        part = torch.zeros((), dtype=torch.int64, device=flat.device)
        for start in range(0, flat.numel(), _HASH_CHUNK):
            piece = flat[start:start + _HASH_CHUNK].to(torch.int64)
            idx = torch.arange(pos + start, pos + start + piece.numel(), dtype=torch.int64, device=flat.device)
            part += (piece * (idx * _K_POS + _K_ADD).bitwise_or_(1)).sum()
        pos += flat.numel()
        h = part if h is None else h * _K_PARAM + part
    return 0 if h is None else int(h.item())


def minority_ranks(hashes: dict[int, int]) -> tuple[list[int], str]:
    """Ranks whose hash differs from a strict majority, and why; ``([], "")`` when all agree.

    Without a strict majority (two replicas that disagree, or an even split) every rank is named.
    """
    groups: dict[int, list[int]] = {}
    for rank, h in sorted(hashes.items()):
        groups.setdefault(h, []).append(rank)
    if len(groups) == 1:
        return [], ""
    ordered = sorted(groups.values(), key=len, reverse=True)
    if len(ordered[0]) * 2 > len(hashes):
        bad = sorted(r for g in ordered[1:] for r in g)
        return bad, f"ranks {bad} hold parameters that differ from the majority {ordered[0]}"
    return sorted(hashes), f"no majority among {len(hashes)} replicas ({len(groups)} different hashes)"


def hash_message(step: int, mine: int, hashes: dict[int, int], every: int | None = None,
                 max_sent: int = 256) -> dict:
    """The ``hash`` datagram a rank sends its node monitor after a check of step ``step``.

    ``mine``: this rank's hash; ``hashes``: every replica's, by global rank (all-gathered, so
    every rank judges the same). ``every``: steps since the previous check that agreed, when it is
    not the watchdog's ``sdc_every_steps`` (the snapshot check runs at every snapshot); a rollback
    goes back that far. Up to ``max_sent`` replicas' hashes travel as evidence (16 bytes each)."""
    minority, reason = minority_ranks(hashes)
    msg = {"k": MSG_HASH, "s": step, "h": f"{mine & (2**64 - 1):016x}", "bad": minority, "why": reason,
           "n": len(hashes)}
    if every is not None:
        msg["every"] = int(every)
    if len(hashes) <= max_sent:
        # Every rank holds every hash after the all-gather: one datagram that arrives is then the
        # whole evidence, also when a peer is stopped before its own is read.
        msg["all"] = {str(r): f"{h & (2**64 - 1):016x}" for r, h in sorted(hashes.items())}
    return msg
