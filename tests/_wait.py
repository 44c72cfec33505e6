"""A bounded poll for tests: no test waits on a condition without a deadline."""

from __future__ import annotations

import time
from typing import Callable


def wait_for(cond: Callable[[], object], timeout_s: float = 5.0, interval_s: float = 0.02) -> bool:
    """Poll ``cond`` until it is true (return True) or ``timeout_s`` passes (return False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(interval_s)
    return False
