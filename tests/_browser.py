"""Load a page in headless Chromium (Debian's ``chromium``) and return its DOM and console lines."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def chromium() -> str:
    """Path of the browser; fail (not skip) when it is missing: ``make test`` installs it."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.fail("chromium is not installed; `make test` installs it (apt-get install chromium), "
                    "or install it yourself to run the report's browser check.")
    return exe


def load(page: Path, timeout_s: float = 60.0) -> tuple[str, list[str]]:
    """(DOM after load, console messages). Any console message of our pages is an error: they log
    nothing on success."""
    proc = subprocess.run(
        [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000",
         "--enable-logging=stderr", "--v=0", "--dump-dom", page.resolve().as_uri()],
        capture_output=True, text=True, timeout=timeout_s,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    console = [ln for ln in proc.stderr.splitlines() if ":CONSOLE" in ln]
    return proc.stdout, console
