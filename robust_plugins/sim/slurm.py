"""A real SLURM on the simulated cluster: ``munged``, ``slurmctld`` and one ``slurmd`` per node.

Layout, on top of a :class:`~robust_plugins.sim.netns.SimCluster`:

* the switch namespace's bridge gets ``10.213.0.254``; ``slurmctld`` runs there as host ``ctl``;
* node ``i``'s namespace runs ``slurmd`` as host ``node<i>`` (its own UTS namespace, so
  ``hostname`` answers ``node<i>`` and torch's c10d store recognises its endpoint), address
  ``10.213.0.<i+1>``;
* one private ``munged`` (its own key and socket under the cluster's directory, so a system munge
  is neither needed nor touched) in the host namespace: its socket is a path, which every network
  namespace sees;
* ``/etc/netns/<namespace>/hosts`` names every node and ``ctl`` (``ip netns exec`` mounts it over
  ``/etc/hosts``), so the host names of ``SLURM_JOB_NODELIST`` resolve inside the cluster.

Everything lives in one temporary directory and the cluster's namespaces; :meth:`SlurmSim.down`
(and the ``with`` block, on every exit path) kills the daemons and removes both. Needs root, the
simulator's iproute2, and Debian's ``slurm-wlm`` and ``munge`` (``make slurm`` installs them):
:func:`slurm_unavailable_reason` says which is missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Mapping, Sequence

from robust_plugins._logging import get_logger
from robust_plugins.sim.netns import SUBNET, SimCluster, SimError, netns_unavailable_reason

_log = get_logger(__name__)

CTL_ADDR = f"{SUBNET}.254"
CTL_HOST = "ctl"
_TOOLS = ("munged", "slurmctld", "slurmd", "slurmstepd", "sbatch", "srun", "scontrol", "sinfo", "unshare", "nsenter")
#: slurmctld answers within 1-3 s here, slurmd registers within ~2 s of it; 60 s covers a loaded box.
_START_TIMEOUT_S = 60.0
_CMD_TIMEOUT_S = 30.0

_CONF = """\
ClusterName=rpsim
SlurmctldHost={ctl}({ctl_addr})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
AuthInfo=socket={dir}/munge.sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={dir}/ctld
SlurmdSpoolDir={dir}/spool/%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=600
MessageTimeout=10
{nodes}
PartitionName=sim Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def slurm_unavailable_reason() -> str | None:
    """Why SLURM cannot run on the simulator here, or ``None`` when it can."""
    reason = netns_unavailable_reason()
    if reason:
        return reason
    missing = [t for t in _TOOLS if shutil.which(t) is None]
    if missing:
        return (f"SLURM on the simulator needs Debian's slurm-wlm and munge (`make slurm` as root); "
                f"not found on PATH: {', '.join(missing)}")
    return None


class SlurmSim:
    """A SLURM cluster of ``nodes`` nodes (``node0``..) on a :class:`SimCluster`.

    ::

        with SlurmSim(nodes=2) as slurm:
            job = slurm.sbatch(script, workdir)
            slurm.wait_job(job, timeout_s=120)

    Commands (:meth:`cmd`) run in the switch namespace with ``SLURM_CONF`` set; jobs run as root in
    the nodes' namespaces with the caller's environment (``sbatch --export=ALL``).
    """

    def __init__(self, nodes: int = 2, *, rate: str = "10gbit", cpus: int = 2) -> None:
        self.cluster = SimCluster(nodes=nodes, ranks_per_node=1, rate=rate)
        self.nodes = [f"node{i}" for i in range(nodes)]
        self.cpus = cpus
        self.dir: Path | None = None
        self._procs: list[subprocess.Popen] = []
        self._etc: list[Path] = []

    @property
    def conf(self) -> Path:
        """The cluster's ``slurm.conf``."""
        return self._need_dir() / "slurm.conf"

    def _need_dir(self) -> Path:
        if self.dir is None:
            raise SimError("SlurmSim is not up; use it inside `with SlurmSim(...)`.")
        return self.dir

    def env(self) -> dict[str, str]:
        """Environment for SLURM's client commands and daemons of this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def __enter__(self) -> "SlurmSim":
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> None:
        """Start the namespaces, munged, slurmctld and the slurmds; wait until every node is idle."""
        reason = slurm_unavailable_reason()
        if reason:
            raise SimError(reason + ".")
        self.cluster.up()
        try:
            self.dir = Path(tempfile.mkdtemp(prefix=f"{self.cluster.name}-slurm-"))
            (self.dir / "ctld").mkdir()
            for n in self.nodes:
                (self.dir / "spool" / n).mkdir(parents=True)
            sw = ["ip", "-n", self.cluster.switch_ns]
            # lo up too: a connection to one's own address (sinfo to slurmctld) goes over it.
            for argv in ([*sw, "addr", "add", f"{CTL_ADDR}/24", "dev", "br0"], [*sw, "link", "set", "lo", "up"]):
                subprocess.run(argv, check=True, capture_output=True, timeout=_CMD_TIMEOUT_S)
            self._write_hosts()
            self._write_conf()
            self._start_munge()
            self._start(self.cluster.switch_ns, CTL_HOST, ["slurmctld", "-D", "-i", "-f", str(self.conf)], "ctld")
            for i, n in enumerate(self.nodes):
                self._start(self.cluster.node_ns[i], n, ["slurmd", "-D", "-f", str(self.conf)], n)
            self.wait_nodes("idle", self.nodes, timeout_s=_START_TIMEOUT_S)
        except BaseException:
            self.down()
            raise

    def _write_hosts(self) -> None:
        lines = ["127.0.0.1 localhost", f"{CTL_ADDR} {CTL_HOST}"]
        lines += [f"{self.cluster.node_addr(i)} {n}" for i, n in enumerate(self.nodes)]
        for ns in [self.cluster.switch_ns, *self.cluster.node_ns]:
            d = Path("/etc/netns") / ns
            d.mkdir(parents=True, exist_ok=True)
            (d / "hosts").write_text("\n".join(lines) + "\n")
            self._etc.append(d)

    def _write_conf(self) -> None:
        nodes = "\n".join(
            f"NodeName={n} NodeAddr={self.cluster.node_addr(i)} CPUs={self.cpus} RealMemory=1000 State=UNKNOWN"
            for i, n in enumerate(self.nodes))
        self.conf.write_text(_CONF.format(ctl=CTL_HOST, ctl_addr=CTL_ADDR, ctld_port=6817, slurmd_port=6818,
                                          dir=self.dir, nodes=nodes))

    def _start_munge(self) -> None:
        key = self.dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        # --force: munged refuses a root-owned socket directory other than its own without it.
        argv = ["munged", "--foreground", "--force", f"--key-file={key}", f"--socket={self.dir}/munge.sock",
                f"--pid-file={self.dir}/munged.pid", f"--log-file={self.dir}/munged.log",
                f"--seed-file={self.dir}/munged.seed"]
        self._popen(argv, "munged")
        _wait_for(lambda: (self.dir / "munge.sock").exists(), 10.0, "munged's socket")

    def _start(self, ns: str, host: str, argv: Sequence[str], log: str) -> None:
        # nsenter, not `ip netns exec`: the latter remounts /sys, which hides /sys/fs/cgroup, and
        # slurmd refuses to start without its cgroup plugin. Its own UTS namespace (slurmd finds
        # its NodeName, slurmctld its SlurmctldHost, by hostname) and mount namespace (the
        # cluster's hosts file over /etc/hosts, for it and every job step it starts).
        hosts = Path("/etc/netns") / ns / "hosts"
        self._popen(["nsenter", f"--net=/run/netns/{ns}", "unshare", "--uts", "--mount", "--propagation", "private",
                     "sh", "-c", f"mount --bind {hosts} /etc/hosts && hostname {host} && exec \"$@\"", "sh", *argv],
                    log)

    def _popen(self, argv: Sequence[str], log: str) -> None:
        out = open(self.dir / f"{log}.out", "wb")
        try:
            proc = subprocess.Popen(list(argv), env=self.env(), stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            out.close()
        self._procs.append(proc)

    def cmd(self, *argv: str, timeout_s: float = _CMD_TIMEOUT_S, check: bool = True,
            env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None) -> str:
        """Run a SLURM client command (``sinfo``, ``sbatch`` ...) in the cluster; its stdout."""
        try:
            proc = subprocess.run(["ip", "netns", "exec", self.cluster.switch_ns, *argv], capture_output=True,
                                  text=True, timeout=timeout_s, env={**self.env(), **(env or {})}, cwd=cwd)
        except subprocess.TimeoutExpired as exc:
            raise SimError(f"`{' '.join(argv)}` did not finish within {timeout_s:g} s.") from exc
        if check and proc.returncode != 0:
            raise SimError(f"`{' '.join(argv)}` failed (exit {proc.returncode}): {proc.stderr.strip()}\n"
                           f"{self.logs()}")
        return proc.stdout

    def node_states(self) -> dict[str, str]:
        """``{node: state}`` as ``sinfo`` prints it (``idle``, ``alloc``, ``drain``, ``down*`` ...)."""
        out = self.cmd("sinfo", "-h", "-N", "-o", "%N %t", check=False)
        return dict(line.split()[:2] for line in out.splitlines() if len(line.split()) >= 2)

    def wait_nodes(self, state: str, nodes: Sequence[str], *, timeout_s: float) -> None:
        """Wait until every one of ``nodes`` is in ``state`` (``sinfo``'s short name)."""
        _wait_for(lambda: all(self.node_states().get(n, "").rstrip("*") == state for n in nodes), timeout_s,
                  f"nodes {list(nodes)} {state}", lambda: f"{self.node_states()}\n{self.logs()}")

    def sbatch(self, argv: Sequence[str], *, cwd: str | os.PathLike,
               env: Mapping[str, str] | None = None) -> str:
        """Submit a batch job (``sbatch`` arguments, the script path last); its job id."""
        out = self.cmd("sbatch", "--parsable", *argv, cwd=cwd, env=env)
        return out.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (``JobState``, ``ExitCode``, ``NodeList`` ...)."""
        out = self.cmd("scontrol", "show", "job", "-o", job_id, check=False)
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def wait_job(self, job_id: str, *, timeout_s: float) -> dict[str, str]:
        """Wait until the job leaves PENDING/RUNNING/COMPLETING; its final fields. Cancels it on timeout."""
        live = ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING", "REQUEUED", "RESIZING", "SUSPENDED")
        try:
            _wait_for(lambda: self.job(job_id).get("JobState") not in live, timeout_s, f"job {job_id} to end",
                      lambda: f"{self.job(job_id)}\n{self.logs()}")
        except SimError:
            self.cmd("scancel", job_id, check=False)
            raise
        return self.job(job_id)

    def logs(self, lines: int = 15) -> str:
        """The last lines of every daemon's log (for error messages)."""
        if self.dir is None:
            return ""
        out = []
        for f in sorted(self.dir.glob("*.log")) + sorted(self.dir.glob("*.out")):
            tail = f.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {f.name}\n" + "\n".join(tail))
        return "\n".join(out)

    def down(self) -> None:
        """Kill the daemons and the jobs' processes, delete the namespaces and files. Idempotent."""
        for proc in reversed(self._procs):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, 9)
                except ProcessLookupError:
                    pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                _log.warning("slurm sim: daemon %d did not exit after SIGKILL", proc.pid)
        self._procs.clear()
        self.cluster.down()  # kills whatever still runs in the namespaces (slurmstepd, job steps)
        for d in self._etc:
            shutil.rmtree(d, ignore_errors=True)
        self._etc.clear()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None


def _wait_for(ok, timeout_s: float, what: str, detail=lambda: "") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ok():
            return
        time.sleep(0.25)
    raise SimError(f"timed out after {timeout_s:g} s waiting for {what}.\n{detail()}")
