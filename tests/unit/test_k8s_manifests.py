"""recipes/k8s/jobset.yaml: the manifests parse, the pods get the variables our code reads, and the
pod script (launch.sh, run by bash with stand-ins for robust, kubectl and hostname) starts the
`robust run` command our parser accepts, with the topology the discovery code reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from robust_plugins.cli.main import build_parser
from robust_plugins.config import PluginConfig
from robust_plugins.topology.sources import K8sEnv, k8s_info

MANIFEST = Path(__file__).parents[2] / "recipes" / "k8s" / "jobset.yaml"
DOCS = list(yaml.safe_load_all(MANIFEST.read_text()))
BY_KIND = {d["kind"]: d for d in DOCS}
JOBSET = BY_KIND["JobSet"]
CONFIG = BY_KIND["ConfigMap"]["data"]
#: What the kubelet fills in for the downward-API fields the pods ask for (a node of rack 3, zone a).
FIELDS = {"spec.nodeName": "gpu-node-7",
          "metadata.labels['jobset.sigs.k8s.io/jobset-name']": "robust-gpt",
          "metadata.labels['jobset.sigs.k8s.io/job-index']": "0"}
LABELS = {"topology.example.com/rack": "rack-3", "topology.kubernetes.io/zone": "zone-a"}


def _pod(job: str) -> dict:
    rjob = next(r for r in JOBSET["spec"]["replicatedJobs"] if r["name"] == job)
    return rjob["template"]["spec"]["template"]["spec"]


def test_manifests_have_the_shape_kubernetes_and_jobset_expect():
    assert [d["kind"] for d in DOCS] == ["ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "JobSet"]
    assert JOBSET["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    assert [r["name"] for r in JOBSET["spec"]["replicatedJobs"]] == ["workers", "spares"]
    for r in JOBSET["spec"]["replicatedJobs"]:
        job = r["template"]["spec"]
        assert job["completionMode"] == "Indexed" and job["parallelism"] == job["completions"]
        pod = job["template"]["spec"]
        assert pod["serviceAccountName"] == BY_KIND["ServiceAccount"]["metadata"]["name"]
        mounts = {m["name"] for c in pod["containers"] for m in c["volumeMounts"]}
        assert mounts == {v["name"] for v in pod["volumes"]}
    rules = BY_KIND["ClusterRole"]["rules"]
    assert rules == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]


def test_the_config_block_is_valid_and_names_the_variables_launch_exports():
    ds = json.loads(CONFIG["ds_config.json"])
    topo = PluginConfig.from_dict(ds["robust_plugins"]).topology
    assert (topo.k8s_node_env, topo.k8s_switch_envs) == ("ROBUST_K8S_NODE", ("ROBUST_K8S_RACK", "ROBUST_K8S_ZONE"))
    exported = {w for line in CONFIG["launch.sh"].splitlines() if line.strip().startswith("export ")
                for w in line.replace("=", " ").split()[1:]}
    assert {topo.k8s_node_env, *topo.k8s_switch_envs} <= exported


def _stubs(tmp: Path, robust_rc: int) -> Path:
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    record = tmp / "calls.jsonl"
    py = f"#!{sys.executable}\nimport json, os, sys\n"
    (bin_dir / "robust").write_text(py + (
        f"open({str(record)!r}, 'a').write(json.dumps({{'robust': sys.argv[1:], 'env': "
        f"{{k: v for k, v in os.environ.items() if k.startswith('ROBUST_K8S_')}}}}) + '\\n')\n"
        f"sys.exit({robust_rc})\n"))
    (bin_dir / "kubectl").write_text(py + (
        f"labels = {LABELS!r}\n"
        f"open({str(record)!r}, 'a').write(json.dumps({{'kubectl': sys.argv[1:]}}) + '\\n')\n"
        "if sys.argv[1] == 'get':\n"
        "    key = sys.argv[-1].split('labels.', 1)[1].rstrip('}').replace('\\\\.', '.')\n"
        "    print(labels.get(key, ''), end='')\n"))
    (bin_dir / "hostname").write_text(py + (
        "short = 'robust-gpt-' + os.environ['JOB'] + '-0-' + os.environ['POD_INDEX']\n"
        "print(short + '.robust-gpt.default.svc.cluster.local' if sys.argv[1:] == ['-f'] else short)\n"))
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return record


def _run_pod(tmp: Path, job: str, pod_index: int, robust_rc: int = 0) -> tuple[int, list[dict], str]:
    record = _stubs(tmp, robust_rc)
    env = {"PATH": f"{tmp / 'bin'}:{os.environ['PATH']}", "JOB": job}
    for var in _pod(job)["containers"][0]["env"]:
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            path = var["valueFrom"]["fieldRef"]["fieldPath"]
            env[var["name"]] = str(pod_index) if "job-completion-index" in path else FIELDS[path]
    script = tmp / "launch.sh"
    script.write_text(CONFIG["launch.sh"])
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    calls = [json.loads(x) for x in record.read_text().splitlines()] if record.exists() else []
    return done.returncode, calls, done.stderr


@pytest.mark.parametrize("job, pod_index, host, spare", [("workers", 0, True, False), ("workers", 3, False, False),
                                                         ("spares", 0, False, True)])
def test_each_pod_starts_robust_run_with_the_rendezvous_and_topology(tmp_path, job, pod_index, host, spare):
    rc, calls, err = _run_pod(tmp_path, job, pod_index)
    assert rc == 0, err
    run = [c for c in calls if "robust" in c]
    assert len(run) == 1
    args = build_parser("run").parse_args(run[0]["robust"])
    assert (args.nnodes, args.nproc_per_node, args.rdzv_backend) == ("4:4", "8", "c10d")
    assert args.rdzv_endpoint == "robust-gpt-workers-0-0.robust-gpt:29400" and args.rdzv_id == "robust-gpt"
    assert args.rdzv_conf == f"is_host={'true' if host else 'false'}" and args.spare is spare
    assert args.local_addr == f"robust-gpt-{job}-0-{pod_index}.robust-gpt.default.svc.cluster.local"
    assert args.module and args.training_script == "robust_plugins.recipes.deepspeed_gpt.train"
    assert args.training_script_args[:2] == ["--config", "/etc/robust/ds_config.json"]
    # The topology discovery code reads what the pod exported, through the config's variable names.
    topo = PluginConfig.from_dict(json.loads(CONFIG["ds_config.json"])["robust_plugins"]).topology
    info = k8s_info(K8sEnv(topo.k8s_node_env, topo.k8s_switch_envs, topo.k8s_domain_env), run[0]["env"])
    assert info == {"host": "gpu-node-7", "switches": ("rack-3", "zone-a")}


def test_an_excluded_pod_taints_its_node_and_leaves_the_job(tmp_path):
    rc, calls, err = _run_pod(tmp_path, "workers", 2, robust_rc=3)
    assert rc == 0, err
    taints = [c["kubectl"] for c in calls if "kubectl" in c and c["kubectl"][0] == "taint"]
    assert taints == [["taint", "nodes", "gpu-node-7", "robust-plugins/excluded=true:NoSchedule", "--overwrite"]]


def test_a_node_without_the_rack_label_fails_before_robust_run(tmp_path, monkeypatch):
    monkeypatch.setitem(LABELS, "topology.example.com/rack", "")
    rc, calls, err = _run_pod(tmp_path, "workers", 1)
    assert rc != 0 and "has no topology.example.com/rack label" in err
    assert not [c for c in calls if "robust" in c]
