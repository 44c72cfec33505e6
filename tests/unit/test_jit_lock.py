"""The JIT build lock (patches/torch_jit_lock.py): a holder killed while it holds the lock no
longer makes every later op load wait forever; a live, foreign or unknown holder is waited for."""

from __future__ import annotations

import inspect
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from torch.utils import cpp_extension

from robust_plugins.patches import torch_jit_lock

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def baton_cls():
    torch_jit_lock.install()
    try:
        yield cpp_extension.FileBaton
    finally:
        torch_jit_lock.undo()


def test_torch_loader_takes_the_lock_through_the_name_the_patch_replaces():
    # _jit_compile looks FileBaton up in its module at each call: that is what install() swaps.
    assert "FileBaton(" in inspect.getsource(cpp_extension._jit_compile)


def test_install_is_idempotent_and_undo_restores_torch(baton_cls):
    from torch.utils.file_baton import FileBaton

    torch_jit_lock.install()
    assert cpp_extension.FileBaton is baton_cls and baton_cls.__wrapped__ is FileBaton
    torch_jit_lock.undo()
    assert cpp_extension.FileBaton is FileBaton


def _kill_holder(lock: str, patched: bool) -> None:
    code = ("import sys, time\n"
            "from torch.utils import cpp_extension\n"
            "from robust_plugins.patches import torch_jit_lock\n"
            f"{'torch_jit_lock.install()' if patched else ''}\n"
            "assert cpp_extension.FileBaton(sys.argv[1]).try_acquire()\n"
            "print('held', flush=True); time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, lock], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)


def test_a_lock_whose_holder_was_killed_is_removed_by_the_next_waiter(tmp_path, baton_cls, caplog):
    lock = str(tmp_path / "lock")
    # torch's own lock: the killed holder leaves an empty file that no waiter can judge.
    _kill_holder(lock, patched=False)
    assert os.path.exists(lock) and open(lock).read() == ""
    os.unlink(lock)
    # With the patch the file names the holder, so the waiter sees it dead and goes on.
    _kill_holder(lock, patched=True)
    assert open(lock).read().split()[1] == torch_jit_lock._HOST
    with caplog.at_level(logging.WARNING, logger="robust_plugins"):
        t0 = time.monotonic()
        baton_cls(lock).wait()
    assert time.monotonic() - t0 < 5 and not os.path.exists(lock)
    assert "removed the JIT build lock" in caplog.text and lock in caplog.text
    # The next loader takes it as usual.
    b = baton_cls(lock)
    assert b.try_acquire() and not baton_cls(lock).try_acquire()
    b.release()
    assert not os.path.exists(lock) and os.listdir(tmp_path) == []


def _waits(baton_cls, lock: str, seconds: float) -> bool:
    """True if wait() is still waiting after ``seconds``."""
    t = threading.Thread(target=baton_cls(lock).wait, daemon=True)
    t.start()
    t.join(seconds)
    return t.is_alive()


def test_a_live_holder_is_waited_for_until_it_releases(tmp_path, baton_cls):
    lock = str(tmp_path / "lock")
    holder = baton_cls(lock)
    assert holder.try_acquire()
    assert _waits(baton_cls, lock, 0.5) and os.path.exists(lock)
    holder.release()
    assert not _waits(baton_cls, lock, 2.0)


@pytest.mark.parametrize("content", ["", "999999999 some-other-host\n"])
def test_an_unknown_or_foreign_holder_is_never_broken(tmp_path, baton_cls, content):
    # An empty lock (a loader without the patch) or a holder on another host (a shared build
    # directory): nothing here can tell whether it is alive, so the lock stays.
    lock = tmp_path / "lock"
    lock.write_text(content)
    assert _waits(baton_cls, str(lock), 0.5)
    assert lock.read_text() == content
    lock.unlink()  # ends the waiting thread
