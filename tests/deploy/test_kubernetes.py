"""deploy/kubernetes: the manifests are valid Kubernetes objects and agree with what ftrt needs.

Each document is read into the ``kubernetes`` client's model of its kind (required fields
checked) and written back: a field the model does not know (a typo, a wrong level) would be
dropped, so the round trip must give the document back unchanged. Then what the trainer's
container runs is parsed by ``ftrt launch``'s own parser, and the probes, the grace period, the
shared memory and the job's config are checked against it. The behaviour the manifests rely on
(drain on SIGTERM, the probes, the downward API's names and addresses as flags) is tested with
real agents in tests/agents/test_drain.py and test_probes.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

pytest.importorskip("kubernetes", reason="the kubernetes client is in the test extra")
from kubernetes.client import ApiClient  # noqa: E402

from ftrt.agents.cli import build_parser, config_from_namespace  # noqa: E402
from ftrt.agents.ops.probes import LIVENESS  # noqa: E402

ROOT = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
MODELS = {("v1", "Service"): "V1Service", ("v1", "ConfigMap"): "V1ConfigMap",
          ("apps/v1", "StatefulSet"): "V1StatefulSet", ("policy/v1", "PodDisruptionBudget"): "V1PodDisruptionBudget"}


class _Body:
    def __init__(self, doc: dict) -> None:
        self.data = json.dumps(doc)


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((ROOT / name).read_text()) if d]


def _by_kind(kind: str, name: str) -> dict:
    return next(d for f in ("etcd.yaml", "trainer.yaml") for d in _docs(f)
                if d["kind"] == kind and d["metadata"]["name"] == name)


@pytest.mark.parametrize("name", ["etcd.yaml", "trainer.yaml"])
def test_every_document_is_a_valid_object_of_its_kind_with_no_unknown_field(name):
    api = ApiClient()
    for doc in _docs(name):
        model = MODELS[(doc["apiVersion"], doc["kind"])]
        obj = api.deserialize(_Body(doc), model)  # raises on a missing required field
        assert api.sanitize_for_serialization(obj) == doc, f"{doc['kind']} {doc['metadata']['name']}: a field " \
                                                           "the model does not know was dropped"


def test_the_kustomization_lists_every_manifest():
    k = yaml.safe_load((ROOT / "kustomization.yaml").read_text())
    assert sorted(k["resources"]) == sorted(p.name for p in ROOT.glob("*.yaml") if p.name != "kustomization.yaml")


def _agent() -> tuple[dict, dict]:
    sts = _by_kind("StatefulSet", "ftrt-trainer")
    pod = sts["spec"]["template"]["spec"]
    return sts, next(c for c in pod["containers"] if c["name"] == "agent")


def _launch_config(container: dict, tmp_path: Path):
    """``ftrt launch``'s config from the container's arguments, with the downward API's values and
    the mounted files stood in for."""
    from ftrt.store.certs import tls_dir

    env = {"POD_NAME": "ftrt-trainer-0", "POD_IP": "10.1.2.3", "JOB_ID": "grpo-1"}
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container["args"]]
    files = tls_dir(tmp_path / "tls")  # the Secret's files: ca.crt, client.crt, client.key
    for flag, stand_in in (("--etcd-cacert", files.ca), ("--etcd-cert", files.client_cert()),
                           ("--etcd-key", files.client_key())):
        i = next(i for i, a in enumerate(args) if a.startswith(flag + "="))
        assert args[i].startswith(f"{flag}=/etc/ftrt/etcd/")  # the mounted Secret
        args[i] = f"{flag}={stand_in}"
    assert container["command"] == ["ftrt", "launch"]
    return config_from_namespace(build_parser().parse_args(args))


def test_the_trainer_runs_a_valid_ftrt_launch_that_its_probes_grace_and_memory_match(tmp_path):
    sts, agent = _agent()
    cfg = _launch_config(agent, tmp_path)
    assert cfg.node_id == "ftrt-trainer-0" and cfg.host == "10.1.2.3" and cfg.job_id == "grpo-1"
    assert cfg.etcd_access.secured and cfg.module == "ftrt.grpo"
    assert cfg.min_nodes <= sts["spec"]["replicas"] <= cfg.max_nodes
    pod = sts["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > cfg.drain_timeout  # the drain ends before the SIGKILL
    assert agent["livenessProbe"]["grpc"] == {"port": cfg.agent_port, "service": LIVENESS}
    assert agent["readinessProbe"]["grpc"] == {"port": cfg.agent_port}  # service "": ready
    assert agent["startupProbe"]["httpGet"] == {"path": "/healthz", "port": cfg.health_port}
    mounts = {m["name"]: m["mountPath"] for m in agent["volumeMounts"]}
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert mounts["dshm"] == "/dev/shm" and shm["emptyDir"]["medium"] == "Memory"  # the memory tier
    secret = next(v for v in pod["volumes"] if v["name"] == "etcd-tls")["secret"]["secretName"]
    assert secret == "ftrt-etcd-tls"


def test_the_job_config_is_a_valid_grpo_config_and_etcd_serves_the_address_the_agents_use(tmp_path):
    from ftrt.grpo.config import load_config as grpo_config

    cm = _by_kind("ConfigMap", "ftrt-job")
    path = tmp_path / "grpo.yaml"
    path.write_text(cm["data"]["grpo.yaml"])
    cfg = grpo_config(path, [])
    assert cfg.checkpoint.interval == "auto" and cfg.checkpoint.url.startswith("s3://")
    _, agent = _agent()
    assert f"--config=/etc/ftrt/job/{path.name}" in agent["args"]
    etcd = _by_kind("StatefulSet", "ftrt-etcd")
    assert etcd["spec"]["replicas"] == 3
    args = etcd["spec"]["template"]["spec"]["containers"][0]["args"]
    members = next(a for a in args if a.startswith("--initial-cluster=")).split("=", 1)[1].split(",")
    assert len(members) == 3 and all(f"ftrt-etcd-{i}=https://ftrt-etcd-{i}.ftrt-etcd:2380" in members
                                     for i in range(3))
    client = _by_kind("Service", "ftrt-etcd-client")
    assert "--etcd=ftrt-etcd-client:2379" in agent["args"] and client["spec"]["ports"][0]["port"] == 2379
    assert _by_kind("PodDisruptionBudget", "ftrt-etcd")["spec"]["minAvailable"] == 2  # quorum kept
