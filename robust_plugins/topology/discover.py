"""Topology discovery: pure parsers plus one thin function that gathers what each rank sees.

Sources, in the order :func:`discover` tries them:

1. an explicit topology file (JSON, or YAML when PyYAML is installed), keyed by host name;
2. ``ROBUST_TOPOLOGY_SIM=NxM``: a simulated layout of N nodes x M ranks, node-major (tests, CLI);
3. NVML fabric info (cluster UUID + clique) for the NVLink domain, when ``pynvml`` and GPUs with
   multi-host NVLink are present (:mod:`robust_plugins.topology.sources`; untested on hardware);
4. ``SLURM_TOPOLOGY_ADDR`` with ``SLURM_TOPOLOGY_ADDR_PATTERN`` (switch tiers and host);
5. Kubernetes labels passed in as environment variables whose names the caller gives
   (:class:`~robust_plugins.topology.sources.K8sEnv`; untested on a real cluster);
6. the host name of every rank (with ``LOCAL_RANK`` as its rail when set), gathered over the
   process group.

Sources 3-6 are per rank and combine: NVML (or a Kubernetes domain label) names the NVLink domain,
SLURM or else Kubernetes names the host and switch tiers, the host name fills in the rest.

Every rank ends with the same table: the per-rank facts are exchanged once with
``all_gather_object`` and the table is computed from the gathered list by pure functions.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import socket
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from robust_plugins.topology.records import RankRecord, TopologyError
from robust_plugins.topology.sources import K8sEnv, current_gpu_bus_id, k8s_info, nvml_info

SIM_ENV = "ROBUST_TOPOLOGY_SIM"
_HOST_KEYS = ("nvlink_domain", "switches", "ranks")
_SIM_RE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


@dataclass(frozen=True)
class Topology:
    """The discovered table: one record per rank, sorted by rank, and where it came from."""

    records: tuple[RankRecord, ...]
    """One record per rank, index = rank."""
    source: str
    """``file:<path>``, ``sim:<NxM>``, ``slurm``, ``k8s`` or ``hostname``; ``+nvml`` when NVML named
    NVLink domains."""


def parse_sim(spec: str) -> tuple[RankRecord, ...]:
    """Records of a simulated ``NxM`` layout: N nodes of M ranks, rank ``r`` on node ``r // M``.

    Node ``i`` is host and NVLink domain ``sim-node<i>``; the rail is ``r % M``.
    """
    m = _SIM_RE.match(spec or "")
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise TopologyError(
            f"{SIM_ENV} = {spec!r} is not a layout; expected NODESxRANKS_PER_NODE with both >= 1, "
            f"e.g. '2x4' for 2 nodes of 4 ranks."
        )
    nodes, per_node = int(m.group(1)), int(m.group(2))
    return tuple(
        RankRecord(rank=r, host=f"sim-node{n}", nvlink_domain=f"sim-node{n}", local_index=i)
        for r in range(nodes * per_node)
        for n, i in [divmod(r, per_node)]
    )


def parse_slurm_topology_addr(addr: str, pattern: str) -> tuple[str, tuple[str, ...]]:
    """Split ``SLURM_TOPOLOGY_ADDR`` by ``SLURM_TOPOLOGY_ADDR_PATTERN`` into (host, switches).

    SLURM's tree plugin writes e.g. ``addr="spine0.leaf3.node17"`` and
    ``pattern="switch.switch.node"``: top tier first. The switches are returned lowest tier first
    (``("leaf3", "spine0")``), the order :class:`RankRecord` uses.
    """
    parts, kinds = addr.split("."), pattern.split(".")
    if len(parts) != len(kinds):
        raise TopologyError(
            f"SLURM_TOPOLOGY_ADDR = {addr!r} has {len(parts)} components but "
            f"SLURM_TOPOLOGY_ADDR_PATTERN = {pattern!r} has {len(kinds)}; they must match."
        )
    bad = [k for k in kinds if k not in ("switch", "node")]
    if bad or kinds.count("node") != 1 or kinds[-1] != "node":
        raise TopologyError(
            f"SLURM_TOPOLOGY_ADDR_PATTERN = {pattern!r}: expected zero or more 'switch' components "
            f"followed by exactly one final 'node'."
        )
    if any(not p for p in parts):
        raise TopologyError(f"SLURM_TOPOLOGY_ADDR = {addr!r} has an empty component.")
    return parts[-1], tuple(reversed(parts[:-1]))


def load_topology_file(path: str) -> dict[str, dict]:
    """Read a topology file: a mapping host name -> ``{nvlink_domain?, switches?, ranks?}``.

    JSON always; ``.yaml``/``.yml`` when PyYAML is installed. ``switches`` is a list, lowest tier
    first; ``ranks`` lists the global ranks on that host in local-index order. Either every host
    lists its ranks (the file is the whole table) or none does (ranks come from the process group).
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise TopologyError(f"topology file {path!r} cannot be read: {exc}") from exc
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError as exc:
            raise TopologyError(
                f"topology file {path!r} is YAML but PyYAML is not installed; "
                f"`pip install pyyaml` or write the file as JSON."
            ) from exc
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise TopologyError(f"topology file {path!r} is not valid YAML: {exc}") from exc
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TopologyError(f"topology file {path!r} is not valid JSON: {exc}") from exc
    return validate_host_table(data, where=path)


def validate_host_table(data: Any, where: str = "topology") -> dict[str, dict]:
    """Check a host table (as loaded from a topology file); return it normalized."""
    if not isinstance(data, Mapping) or not data:
        raise TopologyError(f"{where}: expected a non-empty mapping host name -> entry, got {type(data).__name__}.")
    out: dict[str, dict] = {}
    for host, entry in data.items():
        if not isinstance(host, str) or not host:
            raise TopologyError(f"{where}: host name {host!r} must be a non-empty string.")
        entry = {} if entry is None else entry
        if not isinstance(entry, Mapping):
            raise TopologyError(f"{where}: host {host!r}: expected a mapping, got {type(entry).__name__}.")
        for key in entry:
            if key not in _HOST_KEYS:
                near = difflib.get_close_matches(str(key), _HOST_KEYS, n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                raise TopologyError(
                    f"{where}: host {host!r}: unknown key {key!r}{hint}; allowed: {', '.join(_HOST_KEYS)}."
                )
        domain = entry.get("nvlink_domain", host)
        switches = entry.get("switches", [])
        if not isinstance(domain, str) or not domain:
            raise TopologyError(f"{where}: host {host!r}: nvlink_domain = {domain!r} must be a non-empty string.")
        if not isinstance(switches, list) or not all(isinstance(s, str) and s for s in switches):
            raise TopologyError(f"{where}: host {host!r}: switches = {switches!r} must be a list of names.")
        norm = {"nvlink_domain": domain, "switches": tuple(switches)}
        if "ranks" in entry:
            ranks = entry["ranks"]
            if not isinstance(ranks, list) or not all(
                isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks
            ):
                raise TopologyError(f"{where}: host {host!r}: ranks = {ranks!r} must be a list of ints >= 0.")
            norm["ranks"] = tuple(ranks)
        out[host] = norm
    with_ranks = [h for h, e in out.items() if "ranks" in e]
    if with_ranks and len(with_ranks) != len(out):
        missing = [h for h in out if h not in with_ranks]
        raise TopologyError(
            f"{where}: {len(with_ranks)} of {len(out)} hosts list their ranks; list them for every "
            f"host or for none (missing on {missing[:5]}{'...' if len(missing) > 5 else ''})."
        )
    return out


def records_from_host_table(table: Mapping[str, dict]) -> tuple[RankRecord, ...]:
    """The whole table from a host table in which every host lists its ranks."""
    records: dict[int, RankRecord] = {}
    for host, entry in table.items():
        if "ranks" not in entry:
            raise TopologyError(
                f"host {host!r} does not list its ranks: the file alone cannot place ranks; "
                f"run under a process group or add 'ranks' to every host."
            )
        for i, r in enumerate(entry["ranks"]):
            if r in records:
                raise TopologyError(f"rank {r} is listed on host {records[r].host!r} and on host {host!r}.")
            records[r] = RankRecord(r, host, entry["nvlink_domain"], i, entry["switches"])
    return tuple(records[r] for r in sorted(records))


def records_from_gathered(infos: Sequence[Mapping], table: Mapping[str, dict] | None = None) -> tuple[RankRecord, ...]:
    """The table from what each rank reported (index = rank), optionally enriched by a host table.

    Each info has ``host``, ``local_rank`` (``None`` when the launcher did not set it: the rail is
    then the rank's position among the ranks of its host), ``switches`` (tuple, lowest tier first).
    A host table overrides NVLink domain and switches per host; a host it does not name is an error.
    """
    seen: dict[str, int] = {}
    records = []
    for rank, info in enumerate(infos):
        host = info["host"]
        local = info.get("local_rank")
        if local is None:
            local = seen.get(host, 0)
        seen[host] = seen.get(host, 0) + 1
        domain, switches = info.get("nvlink_domain") or host, tuple(info.get("switches", ()))
        if table is not None:
            if host not in table:
                raise TopologyError(
                    f"rank {rank} runs on host {host!r}, which the topology file does not name "
                    f"(it names {len(table)} hosts: {sorted(table)[:5]}...)."
                )
            domain = table[host]["nvlink_domain"]
            switches = table[host]["switches"] or switches
        records.append(RankRecord(rank, host, domain, int(local), switches))
    return tuple(records)


def local_info(env: Mapping[str, str] | None = None, *, k8s: K8sEnv | None = None, nvml: Any = None,
               use_nvml: bool = True) -> dict:
    """What this rank knows about itself: host, ``LOCAL_RANK``, SLURM or Kubernetes switch tiers,
    and an NVLink domain from NVML or a Kubernetes label (``None``: the host is the domain).

    ``nvml`` is a ``pynvml``-like module (imported when ``None``); ``use_nvml=False`` skips NVML.
    """
    env = os.environ if env is None else env
    host = socket.gethostname()
    switches: tuple[str, ...] = ()
    domain = None
    addr, pattern = env.get("SLURM_TOPOLOGY_ADDR"), env.get("SLURM_TOPOLOGY_ADDR_PATTERN")
    from_k8s = k8s_info(k8s, env) if k8s is not None else None
    if addr and pattern:
        host, switches = parse_slurm_topology_addr(addr, pattern)
    elif from_k8s is not None:
        host, switches = from_k8s["host"], from_k8s["switches"]
    if from_k8s is not None:
        domain = from_k8s.get("nvlink_domain")
    local = env.get("LOCAL_RANK")
    local_rank = int(local) if local not in (None, "") else None
    from_nvml = nvml_info(local_rank or 0, env, nvml, current_gpu_bus_id()) if use_nvml else None
    if from_nvml is not None:
        domain = from_nvml["nvlink_domain"]
    return {"host": host, "local_rank": local_rank, "switches": switches, "nvlink_domain": domain,
            "slurm": bool(addr and pattern), "k8s": from_k8s is not None, "nvml": from_nvml is not None}


def discover(file: str | None = None, *, group: Any = None, env: Mapping[str, str] | None = None,
             k8s: K8sEnv | None = None, nvml: Any = None, use_nvml: bool = True) -> Topology:
    """Discover the table (see the module docstring for the order of sources).

    ``k8s`` names the environment variables carrying Kubernetes labels (``None``: not used);
    ``nvml`` / ``use_nvml`` as for :func:`local_info`.

    With ``torch.distributed`` initialized this is a collective over ``group`` (every rank must
    call it); without it, only a file that lists ranks, ``ROBUST_TOPOLOGY_SIM`` or this one host
    (as a world of one) can be described.
    """
    import torch.distributed as dist

    env = os.environ if env is None else env
    initialized = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(group) if initialized else None
    table = load_topology_file(file) if file else None

    if table is not None and all("ranks" in e for e in table.values()):
        topo = Topology(records_from_host_table(table), f"file:{file}")
    elif table is None and env.get(SIM_ENV):
        topo = Topology(parse_sim(env[SIM_ENV]), f"sim:{env[SIM_ENV].strip()}")
    elif initialized:
        gathered: list = [None] * world
        dist.all_gather_object(gathered, local_info(env, k8s=k8s, nvml=nvml, use_nvml=use_nvml), group=group)
        topo = Topology(records_from_gathered(gathered, table), _source(gathered, file if table is not None else None))
    elif table is not None:
        raise TopologyError(
            f"topology file {file!r} does not list ranks and torch.distributed is not initialized: "
            f"add 'ranks' to every host or run under a process group."
        )
    else:
        info = local_info(env, k8s=k8s, nvml=nvml, use_nvml=use_nvml)
        topo = Topology(records_from_gathered([info]), _source([info], None))
    if world is not None and len(topo.records) != world:
        raise TopologyError(
            f"the topology ({topo.source}) describes {len(topo.records)} ranks but the process group "
            f"has {world}; fix the layout or the launch."
        )
    return topo


def _source(gathered: Sequence[Mapping], file: str | None) -> str:
    base = f"file:{file}" if file else ("slurm" if gathered[0].get("slurm") else
                                        "k8s" if gathered[0].get("k8s") else "hostname")
    return base + ("+nvml" if any(g.get("nvml") for g in gathered) else "")
