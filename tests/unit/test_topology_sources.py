"""NVML and Kubernetes discovery sources, driven by fakes of their INPUTS (a fake pynvml module
object, environment variables). Untested on real GB200 hardware or a real Kubernetes cluster."""

from __future__ import annotations

import ctypes
import types

import pytest

from robust_plugins.config import PluginConfig
from robust_plugins.errors import ConfigError
from robust_plugins.topology import plan_groups
from robust_plugins.topology.discover import local_info, records_from_gathered
from robust_plugins.topology.records import TopologyError
from robust_plugins.topology.sources import K8sEnv, fabric_domain, k8s_info, nvml_info

UUID_A = bytes(range(1, 17))
UUID_B = bytes(range(17, 33))


class _FabricInfo(ctypes.Structure):
    # The layout nvidia-ml-py declares for c_nvmlGpuFabricInfo_t.
    _fields_ = [("clusterUuid", ctypes.c_ubyte * 16), ("status", ctypes.c_uint),
                ("cliqueId", ctypes.c_uint), ("state", ctypes.c_ubyte)]


class _NVMLError(Exception):
    pass


def fake_nvml(gpus: dict, *, init_fails=False, no_fabric=False):
    """A pynvml-like module: ``gpus`` maps a device index (or UUID) to (uuid bytes, clique, state, status)."""
    calls = []

    def init():
        calls.append("init")
        if init_fails:
            raise _NVMLError("NVML_ERROR_DRIVER_NOT_LOADED")

    def fabric(handle, ref):
        if no_fabric:
            raise _NVMLError("NVML_ERROR_NOT_SUPPORTED")
        uuid, clique, state, status = gpus[handle]
        info = ref._obj
        ctypes.memmove(info.clusterUuid, uuid, 16)
        info.cliqueId, info.state, info.status = clique, state, status

    return types.SimpleNamespace(
        nvmlInit=init, nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetCount=lambda: len(gpus), nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetHandleByUUID=lambda u: u, c_nvmlGpuFabricInfo_t=_FabricInfo,
        nvmlDeviceGetGpuFabricInfo=fabric, NVMLError=_NVMLError, calls=calls,
    )


def test_fabric_domain_only_when_the_fabric_is_complete():
    assert fabric_domain(UUID_A, 7, 3, 0) == f"nvl-{UUID_A.hex()}-7"
    assert fabric_domain(UUID_A, 7, 2, 0) is None  # fabric manager still in progress
    assert fabric_domain(UUID_A, 7, 3, 1) is None  # registration failed
    assert fabric_domain(bytes(16), 0, 3, 0) is None  # no multi-host NVLink


def test_nvml_info_reads_the_visible_device_and_shuts_nvml_down():
    nvml = fake_nvml({0: (UUID_A, 1, 3, 0), 5: (UUID_B, 2, 3, 0), "GPU-x": (UUID_B, 9, 3, 0)})
    assert nvml_info(0, {}, nvml) == {"nvlink_domain": f"nvl-{UUID_A.hex()}-1"}
    assert nvml_info(1, {"CUDA_VISIBLE_DEVICES": "3,5"}, nvml) == {"nvlink_domain": f"nvl-{UUID_B.hex()}-2"}
    assert nvml_info(0, {"CUDA_VISIBLE_DEVICES": "GPU-x"}, nvml)["nvlink_domain"].endswith("-9")
    assert nvml.calls.count("init") == nvml.calls.count("shutdown") == 3
    with pytest.raises(TopologyError, match="lists 2 devices"):
        nvml_info(2, {"CUDA_VISIBLE_DEVICES": "0,5"}, nvml)
    # One visible GPU per rank (SLURM --gpus-per-task=1): LOCAL_RANK 2 uses the one it sees.
    assert nvml_info(2, {"CUDA_VISIBLE_DEVICES": "5"}, nvml) == {"nvlink_domain": f"nvl-{UUID_B.hex()}-2"}


def test_nvml_says_nothing_without_driver_gpus_or_fabric():
    assert nvml_info(0, {}, fake_nvml({0: (UUID_A, 1, 3, 0)}, init_fails=True)) is None
    assert nvml_info(0, {}, fake_nvml({})) is None
    assert nvml_info(0, {}, fake_nvml({0: (UUID_A, 1, 3, 0)}, no_fabric=True)) is None


def test_multi_host_nvlink_domain_spans_hosts_in_the_plan():
    # 4 hosts x 2 GPUs; hosts 0-1 share NVLink clique 1, hosts 2-3 clique 2 (an NVL rack split in two).
    infos = []
    for rank in range(8):
        host, local = divmod(rank, 2)
        nvml = fake_nvml({local: (UUID_A, 1 + host // 2, 3, 0)})
        infos.append(local_info({"LOCAL_RANK": str(local)}, nvml=nvml) | {"host": f"h{host}"})
    records = records_from_gathered(infos)
    assert {r.nvlink_domain for r in records} == {f"nvl-{UUID_A.hex()}-1", f"nvl-{UUID_A.hex()}-2"}
    plan = plan_groups(records, tp=4)  # TP of 4 fits a 2-host NVLink domain, not one host
    assert [list(g) for g in plan.intra] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_k8s_labels_give_host_switches_and_domain():
    spec = K8sEnv("K8S_NODE", ("K8S_RACK", "K8S_SPINE"), "K8S_NVL")
    env = {"K8S_NODE": "node-17", "K8S_RACK": "rack3", "K8S_SPINE": "spine0", "K8S_NVL": "nvl-a"}
    assert k8s_info(spec, env) == {"host": "node-17", "switches": ("rack3", "spine0"), "nvlink_domain": "nvl-a"}
    assert k8s_info(spec, {}) is None  # not in a pod with the variables: the source does not apply
    with pytest.raises(TopologyError, match="'K8S_SPINE' is not set"):
        k8s_info(spec, {"K8S_NODE": "n", "K8S_RACK": "r", "K8S_NVL": "d"})
    with pytest.raises(TopologyError, match="'K8S_RACK' is empty"):
        k8s_info(spec, {**env, "K8S_RACK": ""})
    info = local_info({**env, "LOCAL_RANK": "1"}, k8s=spec, use_nvml=False)
    assert (info["host"], info["switches"], info["nvlink_domain"], info["local_rank"]) == \
        ("node-17", ("rack3", "spine0"), "nvl-a", 1)


def test_slurm_wins_over_k8s_for_host_and_switches_and_nvml_over_labels_for_the_domain():
    spec = K8sEnv("K8S_NODE", ("K8S_RACK",), "K8S_NVL")
    env = {"K8S_NODE": "k8s-node", "K8S_RACK": "rackK", "K8S_NVL": "label-domain",
           "SLURM_TOPOLOGY_ADDR": "s0.leaf1.slurm-node", "SLURM_TOPOLOGY_ADDR_PATTERN": "switch.switch.node"}
    info = local_info(env, k8s=spec, nvml=fake_nvml({0: (UUID_B, 4, 3, 0)}))
    assert info["host"] == "slurm-node" and info["switches"] == ("leaf1", "s0")
    assert info["nvlink_domain"] == f"nvl-{UUID_B.hex()}-4" and info["nvml"] and info["k8s"]


def test_k8s_records_plan_rails_and_switch_tiers():
    spec = K8sEnv("K8S_NODE", ("K8S_RACK",))
    infos = [local_info({"K8S_NODE": f"n{r // 2}", "K8S_RACK": f"rack{r // 4}", "LOCAL_RANK": str(r % 2)},
                        k8s=spec, use_nvml=False) for r in range(8)]
    records = records_from_gathered(infos)
    assert [r.host for r in records] == ["n0", "n0", "n1", "n1", "n2", "n2", "n3", "n3"]
    assert records[5].switches == ("rack1",) and records[5].local_index == 1
    assert len(plan_groups(records).rails) == 2


def test_config_k8s_keys():
    t = PluginConfig.from_dict({"topology": {"k8s_node_env": "N", "k8s_switch_envs": ["R"]}}).topology
    assert t.k8s_switch_envs == ("R",)
    with pytest.raises(ConfigError, match="need robust_plugins.topology.k8s_node_env"):
        PluginConfig.from_dict({"topology": {"k8s_switch_envs": ["R"]}})
    with pytest.raises(ConfigError, match="must be a list of environment variable names"):
        PluginConfig.from_dict({"topology": {"k8s_node_env": "N", "k8s_switch_envs": "R"}})


@pytest.mark.timeout(60)
def test_nvml_is_asked_about_the_current_device_by_its_pci_address():
    # CUDA numbers GPUs fastest-first by default, NVML by PCI bus: LOCAL_RANK 0 with
    # CUDA_VISIBLE_DEVICES=0 may be NVML's GPU 3. The rank's current device's PCI address decides.
    from robust_plugins.topology.sources import pci_bus_id

    nvml = fake_nvml({0: (UUID_A, 1, 3, 0), "00000000:3B:00.0": (UUID_B, 4, 3, 0)})
    nvml.nvmlDeviceGetHandleByPciBusId = lambda bus: bus
    bus = pci_bus_id(0, 0x3B, 0)
    assert bus == "00000000:3B:00.0"
    assert nvml_info(0, {"CUDA_VISIBLE_DEVICES": "0"}, nvml, bus) == {"nvlink_domain": f"nvl-{UUID_B.hex()}-4"}
    assert nvml_info(0, {"CUDA_VISIBLE_DEVICES": "0"}, nvml)["nvlink_domain"].endswith("-1")  # no address: index
