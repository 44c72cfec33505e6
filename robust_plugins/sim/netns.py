"""A multi-node cluster on one machine: one Linux network namespace per node, rate-limited links.

Layout of one :class:`SimCluster` named ``rpsim-<pid>-<k>`` (``<pid>`` is the creating process):

* a switch namespace ``<name>-sw`` holding a bridge ``br0``;
* one namespace ``<name>-n<i>`` per node, whose interface ``eth0`` (address ``10.213.0.<i+1>/24``)
  is one end of a veth pair; the other end, ``p<i>``, sits in the switch namespace on ``br0``;
* ``tc qdisc ... tbf rate R`` on both ends of every veth pair, so traffic leaving a node and
  traffic entering it are each limited to R. ``netem`` (delay, loss) is not available on the
  kernels we run on; ``tbf`` is.

Ranks of one node run inside its namespace with ``GLOO_SOCKET_IFNAME=eth0``: gloo connects to the
peer's ``eth0`` address, which for a rank of the same node is a local address the kernel delivers
over loopback (not rate-limited), and for a rank of another node crosses the limited veth pairs.
``MASTER_ADDR`` is node 0's address.

Nothing is created in the host's own network namespace: every device and address lives inside the
cluster's namespaces, so the simulator cannot collide with the machine's network, and deleting the
namespaces deletes everything. Teardown runs on every exit path: the context manager, ``atexit``,
SIGTERM/SIGHUP (turned into ``SystemExit`` so the ``with`` block unwinds) and, for a creator that
was SIGKILLed, :func:`cleanup_leftovers` (``robust sim cleanup``; also run at the start of every
cluster), which deletes ``rpsim-*`` namespaces whose creating process is gone. Rank processes get
``PR_SET_PDEATHSIG`` so they die with the process that launched them, and every :meth:`SimCluster.run`
has a deadline after which all its ranks are killed.

Needs root and iproute2 (``ip``, ``tc``); :func:`require_netns` says which is missing.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

from robust_plugins._logging import get_logger
from robust_plugins.errors import ConfigError, RobustPluginsError

_log = get_logger(__name__)

PREFIX = "rpsim"
SUBNET = "10.213.0"
IFNAME = "eth0"
_NAME_RE = re.compile(rf"^{PREFIX}-(\d+)-\d+(-(sw|n\d+))?$")
_RATE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(bit|kbit|mbit|gbit)?\s*$", re.IGNORECASE)
_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_IP_TIMEOUT_S = 20.0
_MAX_NODES = 200  # node addresses are 10.213.0.1 .. 10.213.0.200 in one /24

_LIVE: set["SimCluster"] = set()
_LIVE_LOCK = threading.Lock()
_COUNTER = [0]
_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_saved_handlers: dict[int, object] = {}


class SimError(RobustPluginsError):
    """The simulator cannot run here (no root, no iproute2), or a simulated run failed or timed out."""


@dataclass(frozen=True)
class RankResult:
    """What one rank process left behind."""

    rank: int
    node: int
    returncode: int
    stdout: str
    stderr: str


def parse_rate(rate: str | float | int) -> float:
    """Link rate in bit/s from ``"200mbit"``, ``"10gbit"``, ``"1.5gbit"``, ``"500kbit"`` or a number of bit/s."""
    if isinstance(rate, (int, float)) and not isinstance(rate, bool):
        value = float(rate)
    else:
        m = _RATE_RE.match(str(rate))
        if not m:
            raise ConfigError(
                f"link rate {rate!r} is not a rate; expected a number with a unit among "
                f"{', '.join(_RATE_UNITS)} (e.g. '200mbit', '10gbit')."
            )
        value = float(m.group(1)) * _RATE_UNITS[(m.group(2) or "bit").lower()]
    if not 8e3 <= value <= 1e12:
        raise ConfigError(f"link rate {rate!r} = {value:g} bit/s is outside [8kbit, 1000gbit].")
    return value


def format_rate(bits_per_s: float) -> str:
    """``2e8`` -> ``'200mbit'``; the inverse of :func:`parse_rate` for round numbers."""
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:g}{unit}"
    return f"{bits_per_s:g}bit"


def netns_unavailable_reason() -> str | None:
    """Why the simulator cannot run here, or ``None`` when it can."""
    if os.geteuid() != 0:
        return "the network-namespace simulator needs root (creating namespaces and tc qdiscs)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"the network-namespace simulator needs iproute2; not found on PATH: {', '.join(missing)}"
    return None


def require_netns() -> None:
    """Raise :class:`SimError` saying what is missing when the simulator cannot run here."""
    reason = netns_unavailable_reason()
    if reason:
        raise SimError(reason + ".")


def _cmd(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=_IP_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise SimError(f"`{' '.join(argv)}` did not finish within {_IP_TIMEOUT_S:g} s.") from exc
    if check and proc.returncode != 0:
        raise SimError(f"`{' '.join(argv)}` failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc


def list_namespaces() -> list[str]:
    """Names of the simulator's namespaces (``rpsim-*``) that exist now, of any creator."""
    out = _cmd("ip", "netns", "list", check=False).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if _NAME_RE.match(n)]


def pid_running(pid: int) -> bool:
    """The process exists and is not a zombie (a dead creator whose parent has not reaped it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return True  # no /proc: kill(0) is all there is
    return stat[stat.rindex(")") + 2] != "Z"


def _kill_namespace_processes(ns: str) -> None:
    pids = _cmd("ip", "netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _delete_namespace(ns: str) -> None:
    _kill_namespace_processes(ns)
    _cmd("ip", "netns", "delete", ns, check=False)


def cleanup_leftovers(*, everything: bool = False) -> list[str]:
    """Delete ``rpsim-*`` namespaces whose creating process is gone (all of them with ``everything``).

    The namespaces of a live creator (another engineer's run on a shared machine) are left alone
    unless ``everything`` is set. Returns the names deleted.
    """
    deleted = []
    for ns in list_namespaces():
        creator = int(_NAME_RE.match(ns).group(1))
        if everything or (creator != os.getpid() and not pid_running(creator)):
            _delete_namespace(ns)
            deleted.append(ns)
    if deleted:
        _log.info("simulator: removed leftover namespaces %s", ", ".join(deleted))
    return deleted


def _set_pdeathsig() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die when the launching process dies


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


class SimCluster:
    """``nodes`` simulated nodes joined by links limited to ``rate`` (see the module docstring).

    Use as a context manager::

        with SimCluster(nodes=2, ranks_per_node=2, rate="200mbit") as cluster:
            results = cluster.run([sys.executable, "train.py"], timeout_s=120)

    Args:
        nodes: number of simulated nodes (namespaces), 1 to 200.
        ranks_per_node: processes started per node by :meth:`run`.
        rate: inter-node link rate (``parse_rate`` syntax), applied in both directions.
        mtu: MTU of the veth links (1500 like a plain Ethernet NIC).
    """

    def __init__(self, nodes: int, ranks_per_node: int, rate: str | float = "10gbit", *, mtu: int = 1500):
        for name, value, hi in (("nodes", nodes, _MAX_NODES), ("ranks_per_node", ranks_per_node, 64)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= hi:
                raise ConfigError(f"{name} = {value!r} must be an int in [1, {hi}].")
        self.nodes = nodes
        self.ranks_per_node = ranks_per_node
        self.rate_bits = parse_rate(rate)
        self.mtu = mtu
        _COUNTER[0] += 1
        self.name = f"{PREFIX}-{os.getpid()}-{_COUNTER[0]}"
        self.switch_ns = f"{self.name}-sw"
        self.node_ns = [f"{self.name}-n{i}" for i in range(nodes)]
        self._procs: list[subprocess.Popen] = []
        self._up = False

    # ----------------------------------------------------------------- life cycle
    @property
    def world_size(self) -> int:
        """Ranks in all nodes."""
        return self.nodes * self.ranks_per_node

    def node_addr(self, node: int) -> str:
        """IPv4 address of ``node``'s ``eth0``."""
        return f"{SUBNET}.{node + 1}"

    def __enter__(self) -> "SimCluster":
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> None:
        """Create the namespaces, links and qdiscs. On any failure everything made so far is removed."""
        require_netns()
        cleanup_leftovers()
        with _LIVE_LOCK:
            _LIVE.add(self)
            if len(_LIVE) == 1:
                _install_signal_handlers()
        self._up = True
        try:
            _cmd("ip", "netns", "add", self.switch_ns)
            sw = ("ip", "-n", self.switch_ns)
            _cmd(*sw, "link", "add", "br0", "type", "bridge")
            _cmd(*sw, "link", "set", "br0", "up")
            for i, ns in enumerate(self.node_ns):
                _cmd("ip", "netns", "add", ns)
                node = ("ip", "-n", ns)
                _cmd(*node, "link", "set", "lo", "up")
                _cmd(*sw, "link", "add", f"p{i}", "mtu", str(self.mtu), "type", "veth",
                     "peer", "name", IFNAME, "mtu", str(self.mtu), "netns", ns)
                _cmd(*sw, "link", "set", f"p{i}", "master", "br0")
                _cmd(*sw, "link", "set", f"p{i}", "up")
                _cmd(*node, "addr", "add", f"{self.node_addr(i)}/24", "dev", IFNAME)
                _cmd(*node, "link", "set", IFNAME, "up")
            self._apply_rate("add")
        except BaseException:
            self.down()
            raise
        _log.info(
            "simulator: %d nodes x %d ranks, links %s (namespaces %s-*)",
            self.nodes, self.ranks_per_node, format_rate(self.rate_bits), self.name,
        )

    def _tbf_args(self) -> list[str]:
        rate_bytes = self.rate_bits / 8
        # tbf must hold at least one timer tick of tokens (rate / HZ; HZ is 250-1000) or it cannot
        # reach its rate, and at least one GSO segment (64 KiB) or it drops them: 4 ms of tokens,
        # never below 128 KiB. 50 ms of queue keeps TCP from seeing drops at these rates.
        burst = max(128 * 1024, int(rate_bytes * 0.004))
        return ["tbf", "rate", f"{int(self.rate_bits)}bit", "burst", str(burst), "latency", "50ms"]

    def _apply_rate(self, verb: str) -> None:
        for i, ns in enumerate(self.node_ns):
            _cmd("tc", "-n", ns, "qdisc", verb, "dev", IFNAME, "root", *self._tbf_args())
            _cmd("tc", "-n", self.switch_ns, "qdisc", verb, "dev", f"p{i}", "root", *self._tbf_args())

    def set_rate(self, rate: str | float) -> None:
        """Change the inter-node link rate of a running cluster (both directions, every link)."""
        if not self._up:
            raise SimError(f"cluster {self.name} is not up; use it inside `with SimCluster(...)`.")
        self.rate_bits = parse_rate(rate)
        self._apply_rate("change")
        _log.info("simulator: links now %s", format_rate(self.rate_bits))

    def down(self) -> None:
        """Kill this cluster's rank processes and delete its namespaces. Idempotent."""
        for proc in self._procs:
            _kill_group(proc)
        self._procs.clear()
        for ns in [*self.node_ns, self.switch_ns]:
            _delete_namespace(ns)
        with _LIVE_LOCK:
            if self in _LIVE:
                _LIVE.discard(self)
                if not _LIVE:
                    _restore_signal_handlers()
        self._up = False

    def exists(self) -> list[str]:
        """This cluster's namespaces that exist now (empty after :meth:`down`)."""
        mine = {*self.node_ns, self.switch_ns}
        return [ns for ns in list_namespaces() if ns in mine]

    # ----------------------------------------------------------------- running ranks
    def rank_env(self, rank: int, master_port: int) -> dict[str, str]:
        """Environment of ``rank``: the torchrun variables plus the simulator's network settings."""
        node, local = divmod(rank, self.ranks_per_node)
        return {
            "RANK": str(rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(local),
            "LOCAL_WORLD_SIZE": str(self.ranks_per_node),
            "GROUP_RANK": str(node),
            "NODE_RANK": str(node),
            "MASTER_ADDR": self.node_addr(0),
            "MASTER_PORT": str(master_port),
            "GLOO_SOCKET_IFNAME": IFNAME,
            "ROBUST_TOPOLOGY_SIM": f"{self.nodes}x{self.ranks_per_node}",
        }

    def spawn(self, node: int, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              stdout=None, stderr=None) -> subprocess.Popen:
        """Start one process (e.g. a ``robust run`` agent) inside ``node``'s namespace and return it.

        It gets the current environment, ``env`` and ``GLOO_SOCKET_IFNAME`` (its ranks talk over
        the node's simulated link), its own session and ``PR_SET_PDEATHSIG`` (which follows the
        calling *thread*: call it from one that outlives the process); :meth:`down` kills it (and
        deleting the namespace kills whatever it started there). The caller bounds its run time.
        """
        if not self._up:
            raise SimError(f"cluster {self.name} is not up; use it inside `with SimCluster(...)`.")
        if not 0 <= node < self.nodes:
            raise ConfigError(f"node {node} is not a node of this {self.nodes}-node cluster.")
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.node_ns[node], *argv],
            env={**os.environ, **(env or {}), "GLOO_SOCKET_IFNAME": IFNAME},
            stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=_set_pdeathsig,
        )
        self._procs.append(proc)
        return proc

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout_s: float,
        env: Mapping[str, str] | None = None,
        master_port: int = 29500,
        check: bool = True,
        grace_s: float = 10.0,
    ) -> list[RankResult]:
        """Run ``argv`` once per rank (rank ``r`` on node ``r // ranks_per_node``); wait for all.

        Every rank gets the current environment, ``env``, :meth:`rank_env` and ``OMP_NUM_THREADS=1``
        (unless set). After ``timeout_s`` every rank is killed and :class:`SimError` names those
        still running. When a rank fails, the others get ``grace_s`` more seconds (a gloo peer
        would otherwise wait for it until its own timeout), then are killed. With ``check`` a
        failed rank raises :class:`SimError` with the tail of its stderr.
        """
        if not self._up:
            raise SimError(f"cluster {self.name} is not up; use it inside `with SimCluster(...)`.")
        if timeout_s <= 0:
            raise ConfigError(f"timeout_s = {timeout_s!r} must be > 0 (every simulated run is bounded).")
        logdir = tempfile.mkdtemp(prefix=f"{self.name}-run-")
        procs, files = [], []
        try:
            for rank in range(self.world_size):
                node = rank // self.ranks_per_node
                child_env = {"OMP_NUM_THREADS": "1", **os.environ, **(env or {}), **self.rank_env(rank, master_port)}
                out = open(os.path.join(logdir, f"{rank}.out"), "w+")
                err = open(os.path.join(logdir, f"{rank}.err"), "w+")
                files.append((out, err))
                proc = subprocess.Popen(
                    ["ip", "netns", "exec", self.node_ns[node], *argv],
                    env=child_env, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                    start_new_session=True, preexec_fn=_set_pdeathsig,
                )
                procs.append(proc)
                self._procs.append(proc)
            deadline = time.monotonic() + timeout_s
            failed_at = None
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                    failed_at = now
                if now > deadline or (failed_at is not None and now > failed_at + grace_s):
                    running = [r for r, p in enumerate(procs) if p.poll() is None]
                    for p in procs:
                        _kill_group(p)
                    if failed_at is None:
                        raise SimError(
                            f"simulated run timed out after {timeout_s:g} s; ranks still running: {running} "
                            f"(all killed). Last stderr of rank {running[0]}:\n"
                            f"{_tail(_read(files[running[0]][1]))}"
                        )
                    break
                time.sleep(0.05)
            results = [
                RankResult(r, r // self.ranks_per_node, p.returncode, _read(o), _read(e))
                for r, (p, (o, e)) in enumerate(zip(procs, files))
            ]
        finally:
            for p in procs:
                _kill_group(p)
                if p in self._procs:
                    self._procs.remove(p)
            for o, e in files:
                o.close()
                e.close()
            shutil.rmtree(logdir, ignore_errors=True)
        bad = [r for r in results if r.returncode != 0]
        if check and bad:
            first = min(bad, key=lambda r: (r.returncode < 0, r.rank))  # a real failure before a kill
            raise SimError(
                f"simulated run failed on ranks {[r.rank for r in bad]} (exit codes "
                f"{[r.returncode for r in bad]}). stderr of rank {first.rank}:\n{_tail(first.stderr)}"
            )
        return results


def _read(f) -> str:
    f.flush()
    f.seek(0)
    return f.read()


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        _log.warning("simulator: rank process %d did not exit after SIGKILL", proc.pid)


def _teardown_all() -> None:
    for cluster in list(_LIVE):
        cluster.down()


def _on_signal(signum, frame) -> None:
    # Unwind through the `with` blocks (their __exit__ tears down) instead of dying in place.
    raise SystemExit(128 + signum)


def _install_signal_handlers() -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread may set handlers; atexit and cleanup_leftovers still cover it
    for sig in _SIGNALS:
        _saved_handlers[sig] = signal.signal(sig, _on_signal)


def _restore_signal_handlers() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for sig, handler in list(_saved_handlers.items()):
        signal.signal(sig, handler)
        del _saved_handlers[sig]


atexit.register(_teardown_all)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m robust_plugins.sim.netns cleanup [--all]`` (same as ``robust sim cleanup``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] != ["cleanup"]:
        print("usage: python -m robust_plugins.sim.netns cleanup [--all]", file=sys.stderr)
        return 2
    require_netns()
    for ns in cleanup_leftovers(everything="--all" in args):
        print(f"deleted {ns}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
