"""Shared pytest setup: make helper modules in tests/ (such as ``_dist``) importable."""

from __future__ import annotations

import os
import sys

_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
