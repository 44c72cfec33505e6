"""Per-rank discovery sources beyond host names: NVML (multi-node NVLink) and Kubernetes labels.

UNTESTED ON REAL HARDWARE. Both are exercised only with fakes of their *inputs* (a fake ``pynvml``
module object, environment variables); the field names and constants follow NVIDIA's NVML
documentation and the Kubernetes downward API, not a run on a GB200 rack or a real cluster.

* **NVML** (``nvidia-ml-py``, imported as ``pynvml``): on systems whose NVLink spans several hosts
  (GB200 NVL72 and similar), GPUs that share an NVLink domain report the same fabric *cluster UUID*
  and *clique id* through ``nvmlDeviceGetGpuFabricInfo`` once the fabric manager has finished
  (``state == NVML_GPU_FABRIC_STATE_COMPLETED``, 3, and ``status == NVML_SUCCESS``). Such GPUs get
  the NVLink domain ``nvl-<uuid hex>-<clique>``, so an intra-"node" group can span hosts. Without
  pynvml, without GPUs, on single-host NVLink or with the fabric not ready, NVML says nothing and
  the domain stays the host (one NVLink domain per host, which is right for HGX boxes).
* **Kubernetes**: node labels are not visible inside a pod; the usual way is the downward API
  (or an admission webhook copying node labels onto the pod) putting them into environment
  variables. The *names* of those variables are configurable: one for the node name, one per switch
  tier (lowest tier first, e.g. the rack / block label, then the spine / zone label) and optionally
  one for the NVLink domain. Example pod spec fragment::

      env:
      - name: K8S_NODE_NAME
        valueFrom: {fieldRef: {fieldPath: spec.nodeName}}
      - name: K8S_RACK
        valueFrom: {fieldRef: {fieldPath: "metadata.labels['topology.example.com/rack']"}}

  with ``"topology": {"k8s_node_env": "K8S_NODE_NAME", "k8s_switch_envs": ["K8S_RACK"]}``.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from robust_plugins.topology.records import TopologyError

#: ``nvmlGpuFabricState_t``: the fabric manager has finished registering this GPU.
NVML_GPU_FABRIC_STATE_COMPLETED = 3
NVML_SUCCESS = 0


@dataclass(frozen=True)
class K8sEnv:
    """Names of the environment variables that carry Kubernetes topology labels into a pod."""

    node: str
    """Variable holding the node name (``spec.nodeName``); the source is used when it is set."""
    switches: tuple[str, ...] = ()
    """Variables holding switch-tier labels, lowest tier first."""
    nvlink_domain: str | None = None
    """Variable holding an NVLink-domain label, if the cluster labels one."""


def k8s_info(spec: K8sEnv, env: Mapping[str, str]) -> dict[str, Any] | None:
    """This rank's ``host``, ``switches`` and (maybe) ``nvlink_domain`` from the label variables.

    Returns ``None`` when the node variable is not set (the source does not apply). A switch or
    domain variable that is named but missing or empty is an error: silently dropping a tier
    would merge racks into one.
    """
    host = env.get(spec.node, "")
    if not host:
        return None
    switches = []
    for var in spec.switches:
        value = env.get(var, "")
        if not value:
            raise TopologyError(
                f"Kubernetes topology: {spec.node} = {host!r} is set but the switch-tier variable {var!r} is "
                f"{'empty' if var in env else 'not set'}; map the label into it with the downward API or "
                f"remove it from topology.k8s_switch_envs."
            )
        switches.append(value)
    out: dict[str, Any] = {"host": host, "switches": tuple(switches)}
    if spec.nvlink_domain:
        domain = env.get(spec.nvlink_domain, "")
        if not domain:
            raise TopologyError(
                f"Kubernetes topology: the NVLink-domain variable {spec.nvlink_domain!r} is not set or empty; "
                f"map the label into it or remove topology.k8s_domain_env."
            )
        out["nvlink_domain"] = domain
    return out


def fabric_domain(cluster_uuid: bytes | Sequence[int], clique_id: int, state: int, status: int) -> str | None:
    """NVLink domain name from one GPU's fabric info, or ``None`` when it names no multi-host domain."""
    raw = bytes(cluster_uuid)
    if state != NVML_GPU_FABRIC_STATE_COMPLETED or status != NVML_SUCCESS or not any(raw):
        return None
    return f"nvl-{raw.hex()}-{int(clique_id)}"


def visible_gpu(local_index: int, visible: Sequence[str]) -> int:
    """Index into ``visible`` (``CUDA_VISIBLE_DEVICES``) of the GPU of the rank with ``LOCAL_RANK``
    ``local_index`` (pure). One visible GPU is the rank's own whatever its local rank (SLURM's
    ``--gpus-per-task=1``, Kubernetes with one GPU a container): the launcher already picked it."""
    if len(visible) == 1:
        return 0
    if local_index >= len(visible):
        raise TopologyError(
            f"NVML: local index {local_index} but CUDA_VISIBLE_DEVICES lists {len(visible)} devices ({list(visible)})."
        )
    return local_index


def pci_bus_id(domain: int, bus: int, device: int) -> str:
    """NVML's form of a PCI address (``nvmlDeviceGetHandleByPciBusId``), e.g. ``00000000:3B:00.0``."""
    return f"{int(domain):08X}:{int(bus):02X}:{int(device):02X}.0"


def current_gpu_bus_id() -> str | None:
    """The PCI address of this thread's current CUDA device (the rank's own GPU once the host set
    it), or None where CUDA is not in use: what NVML is asked about, whatever order CUDA and NVML
    number the GPUs in."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    if not all(hasattr(props, a) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
        return None
    return pci_bus_id(props.pci_domain_id, props.pci_bus_id, props.pci_device_id)


def _device_handle(nvml: Any, local_index: int, env: Mapping[str, str], bus_id: str | None = None):
    if bus_id is not None:
        # The rank's current device by its PCI address: right even where CUDA numbers the GPUs
        # fastest-first and NVML by PCI bus (CUDA_DEVICE_ORDER unset), and whatever LOCAL_RANK is.
        return nvml.nvmlDeviceGetHandleByPciBusId(bus_id)
    visible = [v.strip() for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if visible:
        pick = visible[visible_gpu(local_index, visible)]
        if pick.isdigit():
            return nvml.nvmlDeviceGetHandleByIndex(int(pick))
        return nvml.nvmlDeviceGetHandleByUUID(pick)
    return nvml.nvmlDeviceGetHandleByIndex(local_index)


def nvml_info(local_index: int, env: Mapping[str, str] | None = None, nvml: Any = None,
              bus_id: str | None = None) -> dict[str, Any] | None:
    """This rank's NVLink domain from NVML fabric info, or ``None`` when NVML cannot tell.

    ``nvml`` is the ``pynvml`` module (imported here when ``None``; absent -> ``None``). The GPU is
    the one at PCI address ``bus_id`` (the rank's current CUDA device, :func:`current_gpu_bus_id`)
    when known; else the ``local_index``-th visible device (``CUDA_VISIBLE_DEVICES`` indices or
    UUIDs honoured; indices are NVML's only with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``).
    """
    env = os.environ if env is None else env
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            return None
    try:
        nvml.nvmlInit()
    except Exception:  # no driver / no GPU: NVML has nothing to say, discovery goes on by host name
        return None
    try:
        if nvml.nvmlDeviceGetCount() == 0:
            return None
        handle = _device_handle(nvml, local_index, env, bus_id)
        info = nvml.c_nvmlGpuFabricInfo_t()
        try:
            nvml.nvmlDeviceGetGpuFabricInfo(handle, ctypes.byref(info))
        except (nvml.NVMLError, AttributeError):  # driver or GPU without fabric info (pre-Hopper, HGX)
            return None
        domain = fabric_domain(info.clusterUuid, info.cliqueId, info.state, info.status)
        return None if domain is None else {"nvlink_domain": domain}
    finally:
        nvml.nvmlShutdown()
