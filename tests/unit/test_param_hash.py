"""The SDC check's parameter hash: on the host as before, on a device without moving the model.

``device_hash`` is plain tensor arithmetic, so it runs here on CPU tensors exactly as it would on
a GPU; which of the two ``param_hash`` uses is the pure ``hashes_on_device``.
"""

from __future__ import annotations

import hashlib

import torch

from robust_plugins.watchdog import param_hash as ph
from robust_plugins.watchdog.client import param_hash


def _params():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(37, 5, generator=g), torch.randn(3, generator=g).half(), torch.randn(2, 2, generator=g).double()]


def test_host_hash_is_blake2b_as_before():
    params = _params()
    h = hashlib.blake2b(digest_size=8)
    for p in params:
        h.update(p.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    assert param_hash(params) == int.from_bytes(h.digest(), "little", signed=True)


def test_selection_hashes_device_tensors_on_their_device(monkeypatch):
    assert not ph.hashes_on_device(_params()) and not ph.hashes_on_device([])
    assert ph.hashes_on_device([torch.empty(3, device="meta")])
    seen = []
    monkeypatch.setattr(ph, "hashes_on_device", lambda params: True)
    monkeypatch.setattr(ph, "device_hash", lambda params: seen.append(len(params)) or 42)
    assert param_hash(_params()) == 42 and seen == [3]


def test_device_hash_sees_every_single_bit_flip_and_the_order(monkeypatch):
    params = _params()
    base = ph.device_hash(params)
    assert ph.device_hash([p.clone() for p in params]) == base
    assert ph.device_hash(params[::-1]) != base
    g = torch.Generator().manual_seed(1)
    for i, p in enumerate(params):
        nbytes = p.numel() * p.element_size()
        for byte in torch.randint(0, nbytes, (12,), generator=g).tolist() + [0, nbytes - 1]:
            for bit in (0, 3, 7):
                flipped = [q.clone() for q in params]
                flipped[i].view(-1).view(torch.uint8)[byte] ^= 1 << bit
                assert ph.device_hash(flipped) != base, (i, byte, bit)
    # Chunked passes give the same value as one pass (the chunk only bounds temporaries).
    monkeypatch.setattr(ph, "_HASH_CHUNK", 7)
    assert ph.device_hash(params) == base
