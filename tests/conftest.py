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


# --- Running the suite concurrently (``make test``: pytest-xdist, ``-n 3 --dist loadfile``) -----
#
# Most fault tests wait (on detection timeouts, restarts, rendezvous) while integration tests
# compute. Three workers share the 2 cores, with three rules that keep the waiting tests' timing
# honest: every fault-marked test (the files of :data:`SERIAL_FILES`) runs on one worker, one at a
# time, so no two jobs whose agents time heartbeats and hangs share the cores; a fault test's
# processes run at normal priority and every other test's at nice 10 (CFS gives a nice-0 process
# ~9x the CPU share of a nice-10 one); and the fault tests and the files that take longest start
# first. Any other file's tests go to one worker together (they share module fixtures).

#: Niceness of tests outside the fault tier while the suite runs concurrently.
BACKGROUND_NICE = 10

#: Where the fault-marked tests are: one scheduling unit under ``--dist loadfile`` (a worker runs
#: them in turn). A fault-marked test elsewhere is refused at collection.
SERIAL_FILES = ("tests/fault/", "tests/integration/test_demo.py")
#: Files under ``tests/fault/`` (they use its ``robust_run``) that inject no fault and keep the
#: watchdog's default, generous timeouts: elastic relaunches at another size. They run beside the
#: fault tier like any integration test (and must not be fault-marked).
NOT_SERIAL = ("tests/fault/test_megatron_elastic.py", "tests/fault/test_megatron_elastic_3d.py")

#: Files that take longest (seconds measured under ``make test``); they are scheduled first.
LONG_FILES = ("tests/fault/test_multinode.py", "tests/fault/test_memory_restore.py",
              "tests/integration/test_deepspeed_compression.py", "tests/integration/test_demo.py")
_TIER_ORDER = ("fault", "integration", "distributed", "gpu", "unit")


def _concurrent(config) -> bool:
    return getattr(config, "workerinput", None) is not None  # an xdist worker


def _serial(path: str) -> bool:
    return path not in NOT_SERIAL and any(path == f or (f.endswith("/") and path.startswith(f)) for f in SERIAL_FILES)


def pytest_collection_modifyitems(session, config, items):
    """Fault-marked tests first, then long files, then by tier (integration, distributed, unit);
    a file's tests keep their order."""
    def key(item):
        path = item.nodeid.split("::")[0]
        tier = path.split("/")[1] if path.count("/") >= 2 else "unit"
        rank = LONG_FILES.index(path) if path in LONG_FILES else len(LONG_FILES)
        tier_rank = _TIER_ORDER.index(tier) if tier in _TIER_ORDER else len(_TIER_ORDER)
        return (not _serial(path), rank, tier_rank, path)

    stray = [i.nodeid for i in items if i.get_closest_marker("fault") and not _serial(i.nodeid.split("::")[0])]
    if stray:
        raise pytest.UsageError(f"fault-marked tests outside SERIAL_FILES (tests/conftest.py): {stray[:5]}; "
                                "add their file there so they never run beside another fault test.")
    order = {}
    for i, item in enumerate(items):
        order.setdefault(item.nodeid.split("::")[0], i)
    items.sort(key=lambda item: (key(item), order[item.nodeid.split("::")[0]]))


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with the files of :data:`SERIAL_FILES` as one unit (one worker)."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FaultTierScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::")[0]
            return "fault-tier" if _serial(path) else path

    return FaultTierScheduling(config, log)


@pytest.fixture(autouse=True)
def _no_stray_ranks(request):
    """After each test, no rank forked by ``tests/_dist.py`` may outlive it (module fixtures' ranks
    have ended by then too): any left is killed, and the test fails saying so."""
    yield
    dist = sys.modules.get("_dist")
    left = dist.kill_stray_ranks() if dist is not None else []
    if left:
        pytest.fail(f"ranks {left} forked by tests/_dist.py were still running after the test; killed")


@pytest.fixture(autouse=True)
def _priority(request):
    """Fault tests (their detection bounds assume a responsive machine) at nice 0; the rest at
    nice :data:`BACKGROUND_NICE` when the suite runs concurrently. Children inherit it."""
    if not _concurrent(request.config):
        yield
        return
    want = 0 if request.node.get_closest_marker("fault") else BACKGROUND_NICE
    try:
        os.setpriority(os.PRIO_PROCESS, 0, want)
        _set_own_group_nice(want)
    except PermissionError:  # lowering the niceness needs root: say so once
        if not _NICE_WARNED:
            _NICE_WARNED.append(True)
            import warnings

            warnings.warn("tests/conftest.py: cannot give fault tests back normal priority without root; "
                          "run `make test` as root or with TEST_WORKERS=0.", stacklevel=1)
    yield


_NICE_WARNED: list[bool] = []


def pytest_configure(config):
    """An xdist worker becomes a session of its own, so that with autogroup scheduling (below) its
    tests and the processes they start in its session (``tests/_dist.py``'s fork server and ranks)
    form one scheduling group whose niceness :func:`_priority` sets: background tests' compute
    then weighs as nice 10 against a fault test's processes, not as one nice-0 group beside them."""
    if _concurrent(config) and os.path.exists("/proc/self/autogroup") and os.getsid(0) != os.getpid():
        os.setsid()


def _set_own_group_nice(nice: int) -> None:
    """The autogroup niceness of this worker's session, when it leads one (see pytest_configure)."""
    if os.getsid(0) != os.getpid() or not os.path.exists("/proc/self/autogroup"):
        return
    with open("/proc/self/autogroup", "w") as f:
        f.write(str(nice))

#: How often the background niceness reaches the sessions that background tests start.
AUTOGROUP_SCAN_S = 0.5


def _renice_background_sessions(stop, own_sid: int) -> None:
    """Give each session a background test started (its processes run at nice
    :data:`BACKGROUND_NICE`, inherited) that niceness as a whole, until ``stop`` is set.

    Why: with the kernel's autogroup scheduling on (``/proc/sys/kernel/sched_autogroup_enabled``,
    the default of most distributions) each session is one scheduling group, and a process's nice
    value weighs only against the processes of its own session. torchrun and ``robust run`` start
    every rank in a session of its own, so a background DeepSpeed job's ranks would get the same
    CPU share as a fault test's, nice 10 or not
    (BENCHMARKS.md, "Test suite", has what that cost)."""
    while not stop.wait(AUTOGROUP_SCAN_S):
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
                if int(fields[3]) == own_sid or int(fields[16]) < BACKGROUND_NICE:
                    continue  # the pytest session's own group, or a fault test's process
                with open(f"/proc/{name}/autogroup") as f:  # "/autogroup-<id> nice <n>"
                    if int(f.read().split()[-1]) >= BACKGROUND_NICE:
                        continue
                with open(f"/proc/{name}/autogroup", "w") as f:
                    f.write(str(BACKGROUND_NICE))
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile, or not ours to change


def pytest_sessionstart(session):
    """In one xdist worker (gw0, which lives until the run ends): the session renicer above."""
    workerinput = getattr(session.config, "workerinput", None)
    if workerinput is None or workerinput.get("workerid") != "gw0":
        return
    if not os.path.exists("/proc/self/autogroup"):
        return  # no autogroup scheduling: the processes' own niceness already counts
    import threading

    stop = threading.Event()
    thread = threading.Thread(target=_renice_background_sessions, args=(stop, os.getsid(0)),
                              name="renice-background-sessions", daemon=True)
    thread.start()
    session.config._renice_stop = stop


def pytest_sessionfinish(session):
    stop = getattr(session.config, "_renice_stop", None)
    if stop is not None:
        stop.set()
