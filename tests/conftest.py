"""Shared pytest setup: make helper modules in tests/ (such as ``_dist``) importable."""

from __future__ import annotations

import os
import random
import sys

import pytest

_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)


@pytest.fixture
def draw(request):
    """A seeded ``random.Random`` for a test's random draws (which rank, which step).

    The seed is ``ROBUST_TEST_SEED`` when set, else a fresh one; it is printed and kept in the test
    report's sections, so a failure is reproduced with ``ROBUST_TEST_SEED=<seed> pytest ...``.
    """
    env = os.environ.get("ROBUST_TEST_SEED")
    seed = int(env) if env else random.SystemRandom().randrange(2**32)
    print(f"{request.node.nodeid}: ROBUST_TEST_SEED={seed}")
    request.node.user_properties.append(("ROBUST_TEST_SEED", seed))
    rng = random.Random(seed)
    rng.seed_value = seed
    return rng
