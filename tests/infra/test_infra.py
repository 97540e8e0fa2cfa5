"""The deployable infrastructure in infra/, checked without Docker, Kubernetes or a cloud account.

- Every YAML under infra/ parses.
- KubeRay manifests (infra/k8s/) validate against the CRD OpenAPI schemas of the KubeRay release they
  target (tests/data/kuberay/, source and version in its README), with unknown fields rejected: the
  API server prunes them silently, so a misspelled field would otherwise be a no-op. Mutated copies
  (misspelled, mistyped, missing, out-of-enum fields) must fail.
- What the schema cannot say: KubeRay's own validation rules that matter here, token auth on, no
  NodePort/LoadBalancer/Ingress/host networking, no inline secrets, GPU workers sized for the job.
- Images, working dir, entrypoint and config paths point at files in this repo; the ConfigMap's job
  config loads with the entrypoint's arguments, and a bad key fails.
- infra/Dockerfile references existing files, installs through scripts/setup.sh (whose torch override
  is exercised with a stub venv) and runs as non-root; .dockerignore keeps venvs/outputs/secrets out.
- The cluster launcher config validates against Ray's own schema and config preparation, and keeps
  every port inside its security group.
- The RayJob's entrypoint runs locally, with its exact arguments, against a real Ray head.
- The RayCronJob (scheduled synthetic data) fires on its config's schedule.cron in schedule.timezone,
  runs without --slot, and a tick resolves its own slot; the CRD has no concurrency policy (the job's
  slot lease stands in for Forbid).
"""
from __future__ import annotations

import copy
import gzip
import hashlib
import ipaddress
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import jsonschema
import pytest
import yaml

from pipeline.errors import ConfigError
from pipeline.job.config import load_config
from pipeline.loading.files import SHIPPED_MODELS
from pipeline.synthetic.schedule import parse_cron, parse_slot, zone
from pipeline.synthetic.config import load_synthetic_config
from pipeline.synthetic.plan import resolve_slot
from pipeline_util import manifest, prompt_rows, read_run, write_parquet

REPO = Path(__file__).resolve().parents[2]
INFRA = REPO / "infra"
K8S = INFRA / "k8s"
LAUNCHER = INFRA / "cluster-launcher" / "aws.yaml"
DOCKERFILE = INFRA / "Dockerfile"
CRD_DIR = REPO / "tests" / "data" / "kuberay"

KUBERAY_RELEASE = ("v1.7.0", "59d663aeec13760646da3db9c1cf8cfe883e30b7")
CRD_FILES = {"RayCluster": "ray.io_rayclusters.yaml.gz", "RayJob": "ray.io_rayjobs.yaml.gz",
             "RayCronJob": "ray.io_raycronjobs.yaml.gz"}
CRD_SHA256 = {   # of the uncompressed files, as listed in tests/data/kuberay/README.md
    "ray.io_rayclusters.yaml.gz": "c44704442eef0c6721ad40c1d66782c8bd3fdab9d3344306a5820910a679baa1",
    "ray.io_rayjobs.yaml.gz": "01a5cf3b17c1769fda44af7e82debcd98722f0c27b9ab84d084681c6649121f5",
    "ray.io_raycronjobs.yaml.gz": "31c2c753bba01f7e8e89cb8e8c504131b58ee42090ca536d87f5ac27605a568e",
}
# ray-operator/controllers/ray/utils/constant.go (v1.7.0): MaxRayClusterNameLength, MaxRayJobNameLength,
# MaxRayCronJobNameLength (= 47 - 11: its RayJobs are named <name>-<unix minutes>)
MAX_NAME_LENGTH = {"RayCluster": 53, "RayJob": 47, "RayCronJob": 36}
JOB_KINDS = ("RayJob", "RayCronJob")       # the kinds that run an entrypoint (a RayJob spec)
# entrypoint script -> the loader of its config (jobs/generate.py, jobs/synthetic_data.py)
CONFIG_LOADERS = {"jobs/generate.py": load_config, "jobs/synthetic_data.py": load_synthetic_config}
EXPOSING_SERVICE_TYPES = {"NodePort", "LoadBalancer"}
EXPOSING_KINDS = {"Ingress", "IngressClass", "Gateway", "HTTPRoute", "Route"}

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)   # libyaml: the CRDs are 1-1.4 MB of YAML


# ---- loading --------------------------------------------------------------------------------------
def load_yaml_docs(path: Path) -> list:
    with open(path) as f:
        return [d for d in yaml.load_all(f, Loader=_Loader) if d is not None]


def infra_yaml_files() -> list[Path]:
    return sorted(p for p in INFRA.rglob("*") if p.suffix in (".yaml", ".yml"))


def k8s_objects() -> list[tuple[Path, dict]]:
    return [(p, d) for p in sorted(K8S.glob("*.y*ml")) for d in load_yaml_docs(p)]


def objects_of_kind(kind: str) -> list[dict]:
    return [d for _, d in k8s_objects() if d.get("kind") == kind]


def the_one(kind: str) -> dict:
    found = objects_of_kind(kind)
    assert len(found) == 1, f"expected exactly one {kind} under infra/k8s, found {len(found)}"
    return found[0]


def kuberay_objects() -> list[tuple[Path, dict]]:
    return [(p, d) for p, d in k8s_objects() if d.get("apiVersion", "").startswith("ray.io/")]


def job_spec(obj: dict) -> dict:
    """The RayJobSpec of a RayJob, or of the RayJobs a RayCronJob creates (its jobTemplate)."""
    return obj["spec"]["jobTemplate"] if obj["kind"] == "RayCronJob" else obj["spec"]


def cluster_spec(obj: dict) -> dict:
    """The RayClusterSpec of a RayCluster or of a (cron) job's own cluster."""
    return obj["spec"] if obj["kind"] == "RayCluster" else job_spec(obj)["rayClusterSpec"]


def pod_templates(obj: dict) -> list[tuple[str, dict]]:
    """(role, pod spec) of every pod a KubeRay object creates: head, worker groups, submitter."""
    spec = cluster_spec(obj)
    pods = [("head", spec["headGroupSpec"]["template"]["spec"])]
    pods += [(f"worker:{g['groupName']}", g["template"]["spec"]) for g in spec.get("workerGroupSpecs", [])]
    if obj["kind"] in JOB_KINDS and "submitterPodTemplate" in job_spec(obj):
        pods.append(("submitter", job_spec(obj)["submitterPodTemplate"]["spec"]))
    return pods


def containers(pod: dict) -> list[dict]:
    return pod.get("containers", []) + pod.get("initContainers", [])


def walk(node, path=()):
    """Every (path, key, value) of a YAML tree."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield path, k, v
            yield from walk(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from walk(v, path + (i,))


def rayjob_parts(kind: str = "RayJob") -> tuple[dict, dict, list[str], str]:
    """(RayJob or RayCronJob, its ConfigMap, entrypoint argv, the job config text the entrypoint reads)."""
    job = the_one(kind)
    argv = shlex.split(job_spec(job)["entrypoint"])
    config_path = argv[argv.index("--config") + 1]
    head = cluster_spec(job)["headGroupSpec"]["template"]["spec"]
    mount = next(m for m in head["containers"][0].get("volumeMounts", [])
                 if config_path.startswith(m["mountPath"].rstrip("/") + "/"))
    volume = next(v for v in head.get("volumes", []) if v["name"] == mount["name"])
    cm = next(c for c in objects_of_kind("ConfigMap") if c["metadata"]["name"] == volume["configMap"]["name"])
    key = config_path[len(mount["mountPath"].rstrip("/")) + 1:]
    return job, cm, argv, cm["data"][key]


def job_config(kind: str, tmp_path: Path, extra: list[str] = ()):
    """The (cron) job's config as its entrypoint loads it: its script's loader, its arguments."""
    _, _, argv, text = rayjob_parts(kind)
    return CONFIG_LOADERS[argv[1]](_write(tmp_path, text, f"{kind}.yaml"), argv[argv.index("--config") + 2:] + list(extra))


# ---- schemas --------------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def _crd(kind: str) -> dict:
    with gzip.open(CRD_DIR / CRD_FILES[kind], "rt") as f:
        return yaml.load(f, Loader=_Loader)


def crd_schema(kind: str) -> dict:
    crd = _crd(kind)
    assert crd["kind"] == "CustomResourceDefinition" and crd["spec"]["names"]["kind"] == kind
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    assert v1["served"] and v1["storage"]
    return v1["schema"]["openAPIV3Schema"]


def strict(schema: dict) -> dict:
    """The schema as the API server applies it, for a validator: unknown fields are errors.

    A structural CRD schema prunes (silently drops) every field it does not list, except under
    `x-kubernetes-preserve-unknown-fields: true` or a map (`additionalProperties`). So wherever a
    schema lists `properties` and says nothing else about extra ones, extra ones become errors here.
    `nullable: true` (OpenAPI) becomes an explicit null type."""
    def fix(node: dict) -> dict:                 # node: a schema (never a map of field names)
        node = dict(node)
        if "properties" in node:
            node["properties"] = {name: fix(sub) for name, sub in node["properties"].items()}
            if "additionalProperties" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
                node["additionalProperties"] = False
        if isinstance(node.get("additionalProperties"), dict):
            node["additionalProperties"] = fix(node["additionalProperties"])
        if isinstance(node.get("items"), dict):
            node["items"] = fix(node["items"])
        for key in ("anyOf", "allOf", "oneOf"):
            if key in node:
                node[key] = [fix(sub) for sub in node[key]]
        if node.pop("nullable", False) and isinstance(node.get("type"), str):
            node["type"] = [node["type"], "null"]
        return node
    return fix(schema)


@lru_cache(maxsize=None)
def validator(kind: str, strict_fields: bool = True) -> jsonschema.Draft7Validator:
    schema = crd_schema(kind)
    return jsonschema.Draft7Validator(strict(schema) if strict_fields else schema)


def schema_errors(obj: dict, strict_fields: bool = True) -> list[str]:
    errors = validator(obj["kind"], strict_fields).iter_errors(obj)
    return sorted(f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors)


@lru_cache(maxsize=None)
def ray_launcher_schema() -> dict:
    import ray.autoscaler
    return json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())


# ---- 1. parsing -----------------------------------------------------------------------------------
def test_every_infra_yaml_parses():
    files = infra_yaml_files()
    names = {p.relative_to(INFRA).as_posix() for p in files}
    assert {"k8s/rayjob.yaml", "k8s/raycluster.yaml", "k8s/raycronjob.yaml", "k8s/networkpolicy.yaml",
            "cluster-launcher/aws.yaml"} <= names, names
    for path in files:
        docs = load_yaml_docs(path)
        assert docs, f"{path}: no YAML documents"
        assert all(isinstance(d, dict) for d in docs), f"{path}: every document must be a mapping"
    for _, obj in k8s_objects():
        assert {"apiVersion", "kind", "metadata"} <= set(obj), obj.get("metadata")
        if obj["kind"] == "ConfigMap":                   # YAML inside YAML parses too
            for key, text in obj["data"].items():
                if key.endswith((".yaml", ".yml")):
                    assert isinstance(yaml.safe_load(text), dict), f"ConfigMap {key} is not a YAML mapping"
    # Every KubeRay object has its CRD schema kept here (a new kind needs its CRD in tests/data/kuberay).
    assert {obj["kind"] for _, obj in kuberay_objects()} <= set(CRD_FILES)
    # One RayJob only: the old and the new manifest must not both exist.
    assert len(objects_of_kind("RayJob")) == 1 and len(objects_of_kind("RayCluster")) == 1
    assert len(objects_of_kind("RayCronJob")) == 1


# ---- 2. the CRD schemas kept as test data ---------------------------------------------------------
def test_crd_test_data_is_the_noted_release():
    readme = (CRD_DIR / "README.md").read_text()
    tag, commit = KUBERAY_RELEASE
    assert tag in readme and commit in readme
    for name, digest in CRD_SHA256.items():
        with gzip.open(CRD_DIR / name, "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == digest, f"{name} differs from {tag}"
        assert digest in readme
    # The release supports token auth in the RayCluster spec (the reason for picking it).
    for kind in CRD_FILES:
        spec = crd_schema(kind)["properties"]["spec"]["properties"]
        if kind == "RayCronJob":
            spec = spec["jobTemplate"]["properties"]
        cluster = spec if kind == "RayCluster" else spec["rayClusterSpec"]["properties"]
        assert cluster["authOptions"]["properties"]["mode"]["enum"] == ["disabled", "token"]


# ---- 3. KubeRay manifests against their CRD -------------------------------------------------------
@pytest.mark.parametrize("kind", sorted(CRD_FILES))
def test_kuberay_manifest_validates_against_crd(kind):
    (obj,) = objects_of_kind(kind)
    assert obj["apiVersion"] == "ray.io/v1"
    assert schema_errors(obj) == []


def _rename(d: dict, old: str, new: str) -> None:
    d[new] = d.pop(old)


def _misspell_top_level(obj: dict) -> None:
    if obj["kind"] == "RayCronJob":
        _rename(obj["spec"], "timeZone", "timezone")
    elif obj["kind"] == "RayJob":
        _rename(obj["spec"], "entrypoint", "entryPoint")
    else:
        _rename(obj["spec"], "enableInTreeAutoscaling", "enableInTreeAutoScaling")


MUTATIONS = {
    # (what, mutate(obj, cluster_spec), caught only with unknown fields rejected?)
    "misspelled top-level spec field": (lambda o, c: _misspell_top_level(o), True),
    "misspelled authOptions.secretName": (lambda o, c: _rename(c["authOptions"], "secretName", "secretname"), True),
    "misspelled head rayStartParams": (lambda o, c: _rename(c["headGroupSpec"], "rayStartParams", "rayStartParam"), True),
    "misspelled container field deep in the worker pod": (
        lambda o, c: _rename(c["workerGroupSpecs"][0]["template"]["spec"]["containers"][0], "resources", "resource"), True),
    "misspelled head container field": (
        lambda o, c: _rename(c["headGroupSpec"]["template"]["spec"]["containers"][0], "imagePullPolicy",
                             "imagePullpolicy"), True),
    "misspelled pod field": (
        lambda o, c: _rename(c["workerGroupSpecs"][0]["template"]["spec"], "tolerations", "toleration"), True),
    "auth mode out of its enum": (lambda o, c: c["authOptions"].update(mode="Token"), False),
    "replicas of the wrong type": (lambda o, c: c["workerGroupSpecs"][0].update(replicas="two"), False),
    "worker group without groupName": (lambda o, c: c["workerGroupSpecs"][0].pop("groupName"), False),
    "head without a pod template": (lambda o, c: c["headGroupSpec"].pop("template"), False),
    "container without a name": (
        lambda o, c: c["headGroupSpec"]["template"]["spec"]["containers"][0].pop("name"), False),
    "rayStartParams value not a string": (lambda o, c: c["headGroupSpec"]["rayStartParams"].update({"num-cpus": 0}), False),
}


@pytest.mark.parametrize("kind", sorted(CRD_FILES))
@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_mutated_kuberay_manifest_fails_validation(kind, mutation):
    (obj,) = objects_of_kind(kind)
    mutate, needs_strict = MUTATIONS[mutation]
    bad = copy.deepcopy(obj)
    mutate(bad, cluster_spec(bad))
    assert schema_errors(bad), f"{kind} with a {mutation} passed validation"
    if needs_strict:
        # Why unknown fields must be rejected: the CRD's own schema accepts the typo (the API server
        # would drop the field without a word).
        assert schema_errors(bad, strict_fields=False) == []


def test_strict_schema_keeps_maps_open():
    """Rejecting unknown fields must not reject map keys (labels, rayStartParams, resources)."""
    obj = copy.deepcopy(the_one("RayCluster"))
    spec = cluster_spec(obj)
    spec["headGroupSpec"]["rayStartParams"]["any-ray-start-flag"] = "x"
    spec["headGroupSpec"]["template"]["metadata"]["labels"]["team"] = "x"
    spec["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]["limits"]["example.com/fpga"] = 1
    assert schema_errors(obj) == []


@pytest.mark.parametrize("kind", sorted(CRD_FILES))
def test_kuberay_operator_rules(kind):
    """Checks of ray-operator/controllers/ray/utils/validation.go (v1.7.0) that the schema lacks."""
    (obj,) = objects_of_kind(kind)
    name = obj["metadata"]["name"]
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= MAX_NAME_LENGTH[kind]
    spec = cluster_spec(obj)
    autoscaling = spec.get("enableInTreeAutoscaling", False)
    for group in spec["workerGroupSpecs"]:
        if not autoscaling:
            assert "minReplicas" in group and "maxReplicas" in group, group["groupName"]
        assert 0 <= group["minReplicas"] <= group.get("replicas", group["minReplicas"]) <= group["maxReplicas"]
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        params = group.get("rayStartParams", {})
        if any(params.get(k) for k in ("num-cpus", "num-gpus", "memory", "resources")):
            assert not group.get("resources"), "resources given in both rayStartParams and resources"
        assert "labels" not in params
    if spec.get("authOptions", {}).get("mode") == "token":
        assert tuple(map(int, spec["rayVersion"].split("."))) >= (2, 52, 0), "token auth needs Ray >= 2.52"
        assert not spec["authOptions"].get("enableK8sTokenAuth")     # unsupported for RayJob
    if obj["kind"] == "RayCronJob":
        # ValidateRayCronJobSpec: no TZ= in the schedule (timeZone instead), robfig/cron's standard
        # syntax (5 fields or @descriptors, which pipeline/synthetic/schedule.py reads the same), a time zone.
        assert "TZ" not in obj["spec"]["schedule"] and obj["spec"].get("timeZone")
        assert len(obj["spec"]["schedule"].split()) == 5 or obj["spec"]["schedule"].startswith("@")
    if obj["kind"] in JOB_KINDS:
        job = job_spec(obj)
        assert job.get("submissionMode", "K8sJobMode") == "K8sJobMode"
        assert not job.get("ttlSecondsAfterFinished") or job.get("shutdownAfterJobFinishes")
        assert job.get("backoffLimit", 0) >= 0 and not job.get("clusterSelector")


# ---- 4. security: token auth, nothing exposed, no inline secrets ----------------------------------
@pytest.mark.parametrize("kind", sorted(CRD_FILES))
def test_token_auth_on(kind):
    (obj,) = objects_of_kind(kind)
    spec = cluster_spec(obj)
    auth = spec["authOptions"]
    assert auth["mode"] == "token" and auth["secretName"], auth
    # KubeRay injects RAY_AUTH_MODE/RAY_AUTH_TOKEN only where a container does not set them itself:
    # a container-level value (say RAY_AUTH_MODE=disabled) would silently win.
    for role, pod in pod_templates(obj):
        for c in containers(pod):
            names = {e["name"] for e in c.get("env", [])}
            assert not names & {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"}, (role, names)


def test_nothing_exposed_outside_the_cluster():
    for path, obj in k8s_objects():
        where = f"{path.name}: {obj['kind']} {obj['metadata'].get('name')}"
        assert obj["kind"] not in EXPOSING_KINDS, where
        if obj["kind"] == "Service":
            assert obj["spec"].get("type", "ClusterIP") == "ClusterIP", where
        for keys, key, value in walk(obj):
            assert not (key in ("hostNetwork", "hostPID", "hostIPC", "privileged") and value is True), (where, keys, key)
            assert key != "hostPort", (where, keys)
            assert not (key == "type" and value in EXPOSING_SERVICE_TYPES), (where, keys)
            assert not (key == "cidr" and ipaddress.ip_network(value).prefixlen == 0), (where, keys)
    for kind in CRD_FILES:
        (obj,) = objects_of_kind(kind)
        head = cluster_spec(obj)["headGroupSpec"]
        assert head["serviceType"] == "ClusterIP" and head.get("enableIngress", False) is False
        assert "headService" not in head and "ingressOptions" not in head
        # The dashboard / job API: KubeRay binds it on the pod network (dashboard-host 0.0.0.0 inside
        # the pod); only the ClusterIP Service and the NetworkPolicy lead there. No override here.
        assert "dashboard-host" not in head.get("rayStartParams", {})
        for role, pod in pod_templates(obj):
            assert pod.get("automountServiceAccountToken") is False, role
            for c in containers(pod):
                sc = c.get("securityContext", {})
                assert sc.get("runAsNonRoot") is True and sc.get("allowPrivilegeEscalation") is False, (role, c["name"])


def test_no_inline_secrets(tmp_path):
    secretish = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|ACCESS_KEY|PRIVATE|CREDENTIAL", re.I)
    for path, obj in k8s_objects():
        assert obj["kind"] != "Secret", f"{path.name}: Secrets are created with kubectl, never kept in the repo"
        for keys, key, value in walk(obj):
            if key == "env":
                for e in value:
                    if secretish.search(e["name"]):
                        assert "value" not in e and "valueFrom" in e, (path.name, e["name"])
    for kind in JOB_KINDS:
        storage = job_config(kind, tmp_path).storage
        assert storage.key is None and storage.secret is None   # S3 keys come from the Secret, via AWS_*
    text_all = "\n".join(p.read_text() for p in infra_yaml_files())
    assert not re.search(r"\bAKIA[0-9A-Z]{16}\b", text_all)      # no AWS access key id anywhere


def test_networkpolicy_admits_only_ray_pods_submitters_and_the_operator():
    policy = the_one("NetworkPolicy")
    spec = policy["spec"]
    assert spec["podSelector"]["matchExpressions"] == [
        {"key": "ray.io/node-type", "operator": "In", "values": ["head", "worker"]}]
    assert spec["policyTypes"] == ["Ingress"]
    # Each rule against Kubernetes' NetworkPolicyIngressRule schema (embedded in the RayCluster CRD
    # for its networkPolicy field), unknown fields rejected.
    rule_schema = crd_schema("RayCluster")["properties"]["spec"]["properties"]["networkPolicy"][
        "properties"]["head"]["properties"]["ingressRules"]["items"]
    check = jsonschema.Draft7Validator(strict(rule_schema))
    selector_check = jsonschema.Draft7Validator(strict(rule_schema["properties"]["from"]["items"]["properties"]["podSelector"]))
    assert not list(selector_check.iter_errors(spec["podSelector"]))
    for rule in spec["ingress"]:
        assert not [e.message for e in check.iter_errors(rule)], rule
        assert rule.get("from"), "a rule without `from` admits every source"
        for peer in rule["from"]:
            assert "ipBlock" not in peer
            assert peer.get("podSelector", {}) != {} or peer.get("namespaceSelector"), peer
    ray_peers = [r for r in spec["ingress"] if r["from"] == [{"podSelector": {"matchLabels": {"ray.io/is-ray-node": "yes"}}}]]
    assert len(ray_peers) == 1 and "ports" not in ray_peers[0]        # Ray pods talk on every Ray port
    others = [r for r in spec["ingress"] if r not in ray_peers]
    assert others and all(r["ports"] == [{"protocol": "TCP", "port": 8265}] for r in others)  # job API only


# ---- 5. GPUs and sizing ---------------------------------------------------------------------------
def _quantity(value) -> float:
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


@pytest.mark.parametrize("kind", sorted(CRD_FILES))
def test_gpu_worker_group_and_cpu_head(kind):
    (obj,) = objects_of_kind(kind)
    spec = cluster_spec(obj)
    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in head["resources"].get("limits", {})
    assert "nvidia.com/gpu" not in head["resources"].get("requests", {})
    assert spec["headGroupSpec"]["rayStartParams"].get("num-cpus") == "0"    # driver only
    gpu_groups = [g for g in spec["workerGroupSpecs"]
                  if int(g["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu", 0)) >= 1]
    assert gpu_groups, "no worker group with an nvidia.com/gpu limit"
    for g in gpu_groups:
        res = g["template"]["spec"]["containers"][0]["resources"]
        assert res["requests"].get("nvidia.com/gpu", res["limits"]["nvidia.com/gpu"]) == res["limits"]["nvidia.com/gpu"]


@pytest.mark.parametrize("kind", JOB_KINDS)
def test_job_config_fits_the_rayjob_cluster(kind, tmp_path):
    """Actors that cannot be placed would wait forever: the job's actors must fit the GPU pods."""
    job = the_one(kind)
    cfg = job_config(kind, tmp_path)
    assert cfg.models.device == "cuda" and cfg.cluster.num_gpus_per_worker == 1
    actors = 0
    for g in cluster_spec(job)["workerGroupSpecs"]:
        limits = g["template"]["spec"]["containers"][0]["resources"]["limits"]
        pod_gpus = int(limits.get("nvidia.com/gpu", 0))
        if not pod_gpus:
            continue
        per_pod = int(pod_gpus // cfg.cluster.num_gpus_per_worker)
        assert per_pod * cfg.cluster.num_cpus_per_worker <= _quantity(limits["cpu"]), g["groupName"]
        actors += per_pod * g["minReplicas"]
    assert cfg.cluster.num_workers <= actors, (cfg.cluster.num_workers, actors)


# ---- 6. images, entrypoint and paths point into this repo -----------------------------------------
def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if buf and line.lstrip().startswith("#"):
            continue
        buf += line.rstrip()
        if buf.endswith("\\"):
            buf = buf[:-1] + " "
            continue
        instr, _, args = buf.strip().partition(" ")
        out.append((instr.upper(), args.strip()))
        buf = ""
    return out


def _dockerfile_args() -> dict[str, str]:
    return dict(a.split("=", 1) if "=" in a else (a, "") for i, a in _dockerfile() if i == "ARG")


def _workdir() -> str:
    (workdir,) = [a for i, a in _dockerfile() if i == "WORKDIR"]
    return workdir


def _repo_path(container_path: str) -> Path:
    """A path inside the image -> the file in this repo it comes from (COPY . <WORKDIR>)."""
    root = _workdir().rstrip("/") + "/"
    assert container_path.startswith(root), f"{container_path} is not under the image's {root}"
    return REPO / container_path[len(root):]


def test_images_and_working_dirs_are_this_repo():
    version = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    images = set()
    for kind in CRD_FILES:
        (obj,) = objects_of_kind(kind)
        assert cluster_spec(obj)["rayVersion"] == _dockerfile_args()["RAY_VERSION"]
        for role, pod in pod_templates(obj):
            for c in containers(pod):
                images.add(c["image"])
                if role != "submitter":
                    assert c.get("workingDir") == _workdir(), (role, c["name"])
    (image,) = images                                    # one image everywhere: the one infra/Dockerfile builds
    repository, _, tag = image.rpartition(":")
    assert repository.rsplit("/", 1)[-1] == "specpipe" and tag == version, image
    assert f"specpipe:{version}" in DOCKERFILE.read_text()   # the build command in its header


ENTRYPOINTS = {"RayJob": ("jobs/generate.py", "/config/job.yaml"),
               "RayCronJob": ("jobs/synthetic_data.py", "/config/synthetic.yaml")}


@pytest.mark.parametrize("kind", JOB_KINDS)
def test_entrypoint_and_config_paths_point_into_the_repo(kind, tmp_path):
    job, cm, argv, text = rayjob_parts(kind)
    script_name, config_path = ENTRYPOINTS[kind]
    assert argv[:2] == ["python", script_name]
    script = REPO / argv[1]                              # relative to workingDir == the repo root
    assert script.is_file()
    assert argv.count("--config") == 1 and argv[argv.index("--config") + 1] == config_path
    # The scheduled job takes its slot from the clock: a fixed --slot would rerun one slot forever.
    assert not any(a == "--slot" or a.startswith("--slot=") for a in argv)
    head = cluster_spec(job)["headGroupSpec"]["template"]["spec"]
    (mount,) = [m for m in head["containers"][0]["volumeMounts"] if m["mountPath"] == "/config"]
    assert mount.get("readOnly") is True
    cfg = job_config(kind, tmp_path)
    if kind == "RayCronJob":                             # the job sets input.path (the slot's rows)
        seeds = cfg.synthetic.seeds
        assert seeds.startswith("/app/") and _repo_path(seeds).is_file(), seeds
        assert cfg.output.path.startswith("s3://"), "pods share no disk: output must be on object storage"
        assert cfg.models.target in SHIPPED_MODELS or _repo_path(cfg.models.target).exists()
        return
    # Local paths of the config are paths inside the image, i.e. files of this repo.
    for key, value in (("input.path", cfg.input.path), ("models.target", cfg.models.target),
                       ("models.draft", cfg.models.draft)):
        if value is None or "://" in value or value in SHIPPED_MODELS:
            continue
        assert value.startswith("/"), f"{key}={value}: relative to the job's cwd; use an absolute path"
        assert _repo_path(value).exists(), f"{key}={value} is not in the image"
    assert cfg.input.path.startswith("/app/") and _repo_path(cfg.input.path).is_dir()
    assert cfg.output.path.startswith("s3://"), "pods share no disk: output must be on object storage"
    assert cfg.models.target in SHIPPED_MODELS or _repo_path(cfg.models.target).exists()


@pytest.mark.parametrize("kind", JOB_KINDS)
def test_configmap_config_loads_and_bad_keys_fail(kind, tmp_path):
    _, cm, argv, text = rayjob_parts(kind)
    overrides = argv[argv.index("--config") + 2:]
    load_config = CONFIG_LOADERS[argv[1]]               # this entrypoint's loader
    path = _write(tmp_path, text)
    cfg = load_config(path, overrides)
    assert cfg.run.progress is False and cfg.models.dtype == "bfloat16"
    with pytest.raises(ConfigError, match="engine.max_num_seq"):
        load_config(path, overrides + ["engine.max_num_seq=8"])               # misspelled key
    with pytest.raises(ConfigError, match="models.device"):
        load_config(path, overrides + ["models.device=tpu"])                  # bad value
    with pytest.raises(ConfigError, match="num_gpus_per_worker"):
        load_config(path, overrides + ["cluster.num_gpus_per_worker=0"])      # cuda without GPUs
    bad = _write(tmp_path, text.replace("max_num_seqs:", "max_num_seq:"), "bad.yaml")
    with pytest.raises(ConfigError, match="max_num_seq"):
        load_config(bad, overrides)
    if kind == "RayCronJob":
        with pytest.raises(ConfigError, match="schedule.cron"):
            load_config(path, overrides + ["schedule.cron='61 * * * *'"])
        with pytest.raises(ConfigError, match="schedule.timezone"):
            load_config(path, overrides + ["schedule.timezone=Mars/Olympus"])
        with pytest.raises(ConfigError, match="synthetic.samples_per_seed"):
            load_config(path, overrides + ["synthetic.samples_per_seed=0"])


# ---- 6b. the RayCronJob: its schedule is the job's, and a second run of a slot is harmless --------
def _cron_parts(tmp_path: Path):
    cron_job = the_one("RayCronJob")
    return cron_job, job_config("RayCronJob", tmp_path)


def test_raycronjob_schedule_and_time_zone_equal_the_job_config(tmp_path):
    """The operator fires at spec.schedule in spec.timeZone; the job, run without --slot, names the
    slot from schedule.cron in schedule.timezone. If they differed, a tick would run another slot
    than its own (or none: an unmatched slot is an error)."""
    cron_job, cfg = _cron_parts(tmp_path)
    spec = cron_job["spec"]
    assert spec["schedule"] == cfg.schedule.cron
    assert spec["timeZone"] == cfg.schedule.timezone     # stated: the operator's own zone otherwise
    assert spec.get("suspend", False) is False


def test_raycronjob_concurrency_policy():
    """Forbid where the CRD has a concurrency policy. The v1.7.0 RayCronJob has none (spec: schedule,
    timeZone, suspend, jobTemplate): every tick creates a RayJob, also while the last one runs; the
    job's slot lease makes a second run of a held or committed slot exit 0 without writing
    (tests/synthetic/test_synthetic.py). When a KubeRay release adds the field, this test asks for Forbid."""
    cron_job = the_one("RayCronJob")
    fields = crd_schema("RayCronJob")["properties"]["spec"]["properties"]
    assert set(fields) == {"schedule", "timeZone", "suspend", "jobTemplate"}   # v1.7.0
    policy = [f for f in fields if "concurren" in f.lower()]
    if policy:
        (name,) = policy
        assert "Forbid" in fields[name].get("enum", ["Forbid"]) and cron_job["spec"].get(name) == "Forbid"
    else:
        assert not [k for k in cron_job["spec"] if "concurren" in k.lower()]
        with_policy = copy.deepcopy(cron_job)
        with_policy["spec"]["concurrencyPolicy"] = "Forbid"                 # would be pruned silently
        assert schema_errors(with_policy) and not schema_errors(with_policy, strict_fields=False)


def test_raycronjob_tick_resolves_its_own_slot(tmp_path):
    """The entrypoint's slot resolution (jobs/synthetic_data.py: resolve_slot(cfg.schedule, None))
    at fixed times: a driver starting after a tick, within the schedule's period, names that tick."""
    from datetime import datetime, timedelta, timezone
    cron_job, cfg = _cron_parts(tmp_path)
    cron = parse_cron(cfg.schedule.cron)
    tz = zone(cfg.schedule.timezone)
    now = datetime(2026, 11, 30, 10, 25, 7, tzinfo=timezone.utc)
    slot = resolve_slot(cfg.schedule, None, now=now)
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}T\d{2}(-\d{2})?", slot), slot
    assert slot == "2026-11-30T10"                       # hourly, UTC: the hour that just started
    wall = parse_slot(slot, cron)                        # a fire time of the schedule, as --slot would be
    assert cron.matches(wall) and wall.replace(tzinfo=tz) <= now
    # Fire times over a week: the driver starts at most preRunningDeadlineSeconds after its tick, so
    # that must be shorter than the shortest gap, or a slow start would name the next slot.
    start = datetime(2026, 11, 30, tzinfo=tz)
    fires = [start + timedelta(minutes=m) for m in range(7 * 24 * 60) if cron.matches(start + timedelta(minutes=m))]
    gap = min(b - a for a, b in zip(fires, fires[1:]))
    deadline = timedelta(seconds=job_spec(cron_job)["preRunningDeadlineSeconds"])
    assert deadline < gap, (deadline, gap)
    for tick in fires[:3]:
        assert resolve_slot(cfg.schedule, None, now=(tick + deadline).astimezone(timezone.utc)) == \
            tick.strftime("%Y-%m-%dT%H")


CRON_MUTATIONS = {
    # (mutate(spec), caught only with unknown fields rejected?)
    "misspelled timeZone": (lambda s: _rename(s, "timeZone", "timezone"), True),
    "misspelled jobTemplate field": (lambda s: _rename(s["jobTemplate"], "entrypoint", "entryPoint"), True),
    "misspelled jobTemplate": (lambda s: _rename(s, "jobTemplate", "jobtemplate"), False),   # required
    "empty timeZone": (lambda s: s.update(timeZone=""), False),                               # minLength 1
    "schedule missing": (lambda s: s.pop("schedule"), False),
    "schedule not a string": (lambda s: s.update(schedule=0), False),
    "suspend not a boolean": (lambda s: s.update(suspend="no"), False),
}


@pytest.mark.parametrize("mutation", sorted(CRON_MUTATIONS))
def test_mutated_raycronjob_fails_validation(mutation):
    bad = copy.deepcopy(the_one("RayCronJob"))
    mutate, needs_strict = CRON_MUTATIONS[mutation]
    mutate(bad["spec"])
    assert schema_errors(bad), f"RayCronJob with a {mutation} passed validation"
    if needs_strict:
        assert schema_errors(bad, strict_fields=False) == []


def _write(tmp_path: Path, text: str, name: str = "job.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# ---- 7. Dockerfile, build context, setup.sh -------------------------------------------------------
def _dockerignore_patterns() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    patterns = [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]
    assert not any(p.startswith("!") for p in patterns), "exceptions are not modelled by this test"
    return patterns


def _pattern_regex(pattern: str) -> re.Pattern:
    """Docker's .dockerignore matching (moby/patternmatcher): from the context root, `*` and `?`
    within one path segment, `**` across segments."""
    p, out, i = pattern.strip("/"), "", 0
    while i < len(p):
        if p.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif p.startswith("**", i):
            out, i = out + ".*", i + 2
        elif p[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif p[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(p[i]), i + 1
    return re.compile(out)


def _ignored(rel: str, patterns: list[str]) -> bool:
    parts = rel.split("/")
    prefixes = ["/".join(parts[:k]) for k in range(1, len(parts) + 1)]   # a matched folder drops all below
    return any(_pattern_regex(p).fullmatch(prefix) for p in patterns for prefix in prefixes)


def test_dockerfile_builds_from_this_repo_with_setup_sh():
    instrs = _dockerfile()
    first_from = next(i for i, (ins, _) in enumerate(instrs) if ins == "FROM")
    pre_args = dict(a.split("=", 1) for ins, a in instrs[:first_from] if ins == "ARG")
    assert pre_args.get("BASE") == "python:3.11-slim"                 # CPU default
    assert instrs[first_from][1] == "${BASE}"
    assert "nvidia/cuda:" in DOCKERFILE.read_text()                   # the CUDA base is documented
    patterns = _dockerignore_patterns()
    for ins, args in instrs:
        if ins in ("COPY", "ADD"):
            words = [w for w in shlex.split(args) if not w.startswith("--")]
            assert ins == "COPY" and len(words) >= 2
            for src in words[:-1]:
                assert (REPO / src).exists(), src
                assert src == "." or not _ignored(src, patterns), f"{src} is excluded by .dockerignore"
    runs = " ".join(a for ins, a in instrs if ins == "RUN")
    assert "bash scripts/setup.sh" in runs and 'SPECPIPE_TORCH="$torch"' in runs
    assert "PIP_CONSTRAINT" in runs and "ray==${RAY_VERSION}" in runs
    # The install runs after the code is copied, as the non-root user, from the working dir.
    setup_at = next(i for i, (ins, a) in enumerate(instrs) if ins == "RUN" and "scripts/setup.sh" in a)
    copy_at = next(i for i, (ins, _) in enumerate(instrs) if ins == "COPY")
    users = [(i, a) for i, (ins, a) in enumerate(instrs) if ins == "USER"]
    assert copy_at < setup_at and users and users[0][0] < setup_at
    final_user = users[-1][1].split(":")[0]
    assert final_user not in ("root", "0") and final_user.isdigit() and int(final_user) > 0   # numeric: runAsNonRoot
    # setup.sh creates /app/.venv as that user: /app must be its own (WORKDIR creates it as root).
    owner_at = next(i for i, (ins, a) in enumerate(instrs) if ins == "RUN" and f"-o {final_user} " in a and " /app" in a)
    assert owner_at < setup_at
    assert _workdir() == "/app"
    env = " ".join(a for ins, a in instrs if ins == "ENV")
    assert "PATH=/app/.venv/bin:$PATH" in env
    assert re.match(r"\d+\.\d+\.\d+$", _dockerfile_args()["RAY_VERSION"])
    assert not any(ins in ("ENTRYPOINT",) for ins, _ in instrs)       # KubeRay sets the command


def test_dockerignore_keeps_code_and_drops_environments():
    patterns = _dockerignore_patterns()
    for excluded in (".venv/bin/python", ".git/HEAD", ".git", "out/demo/_SUCCESS", "bench/.venv-vllm/bin/x",
                     "bench/out/r.json", "pipeline/job/__pycache__/config.cpython-311.pyc", "specpipe.egg-info/PKG-INFO",
                     "configs/auth_token", "deep/dir/.env", "key.pem"):
        assert _ignored(excluded, patterns), excluded
    # What setup.sh (pip install -e .) and the job need, walked from the real tree.
    context = set()
    for root, dirs, files in os.walk(REPO):
        rel_root = Path(root).relative_to(REPO).as_posix()
        rel = (lambda n: n) if rel_root == "." else (lambda n, r=rel_root: f"{r}/{n}")
        dirs[:] = [d for d in dirs if not _ignored(rel(d), patterns)]
        context.update(rel(f) for f in files if not _ignored(rel(f), patterns))
    needed = {"pyproject.toml", "README.md", "scripts/setup.sh", "jobs/generate.py", "pipeline/__init__.py",
              "pipeline/job/config.py", "configs/demo.yaml"}
    needed |= {p.relative_to(REPO).as_posix() for p in (REPO / "data" / "demo").iterdir()}
    assert needed <= context, needed - context
    assert not any(p.startswith((".venv/", ".git/", "out/")) for p in context)


def _run_setup_sh(tmp_path: Path, torch_env: str | None, gpu: bool) -> tuple[int, str, list[str]]:
    """scripts/setup.sh in a copy of the repo layout with a stub .venv/bin/python that logs each
    `pip install` instead of installing; a stub nvidia-smi when `gpu`."""
    root = tmp_path / f"repo-{torch_env}-{gpu}"
    (root / "scripts").mkdir(parents=True)
    (root / "scripts" / "setup.sh").write_text((REPO / "scripts" / "setup.sh").read_text())
    log = root / "pip.log"
    stub = root / ".venv" / "bin" / "python"
    stub.parent.mkdir(parents=True)
    stub.write_text(f'#!/bin/sh\necho "$*" >> {shlex.quote(str(log))}\n')
    stub.chmod(0o755)
    bin_dir = tmp_path / f"bin-{gpu}"                  # PATH: only the tools setup.sh uses (and no
    bin_dir.mkdir(exist_ok=True)                       # real nvidia-smi, which a GPU machine has)
    for tool in ("bash", "sh", "dirname", "grep"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    if gpu:
        smi = bin_dir / "nvidia-smi"
        smi.write_text("#!/bin/sh\necho 'GPU 0: stub'\n")
        smi.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "SPECPIPE_TORCH"}
    env["PATH"] = str(bin_dir)
    if torch_env is not None:
        env["SPECPIPE_TORCH"] = torch_env
    proc = subprocess.run([str(bin_dir / "bash"), str(root / "scripts" / "setup.sh")], env=env, capture_output=True,
                          text=True, timeout=60)
    return proc.returncode, proc.stderr, log.read_text().splitlines() if log.exists() else []


@pytest.mark.parametrize("torch_env,gpu,expected", [
    (None, False, "torch==2.13.0+cpu"), ("auto", False, "torch==2.13.0+cpu"),
    (None, True, "torch==2.13.0"), ("cpu", True, "torch==2.13.0+cpu"), ("cuda", False, "torch==2.13.0")])
def test_setup_sh_torch_build_override(tmp_path, torch_env, gpu, expected):
    rc, err, pip_calls = _run_setup_sh(tmp_path, torch_env, gpu)
    assert rc == 0, err
    torch_calls = [c for c in pip_calls if " torch==" in f" {c}"]
    assert torch_calls and torch_calls[0].split()[-1] == expected, pip_calls
    assert any('-e .[dev,plots]' in c for c in pip_calls)           # then the package, as always


def test_setup_sh_rejects_an_unknown_torch_build(tmp_path):
    rc, err, pip_calls = _run_setup_sh(tmp_path, "rocm", False)
    assert rc == 2 and "SPECPIPE_TORCH" in err and pip_calls == []   # fails before touching anything


# ---- 8. the cluster launcher (VMs) ----------------------------------------------------------------
def _launcher() -> dict:
    (cfg,) = load_yaml_docs(LAUNCHER)
    return cfg


def _prepared_launcher() -> dict:
    from ray.autoscaler._private.util import prepare_config, validate_config
    cfg = prepare_config(copy.deepcopy(_launcher()))       # merged with Ray's AWS defaults, as `ray up` does
    validate_config(cfg)
    return cfg


def test_cluster_launcher_validates_against_ray_schema():
    jsonschema.validate(_launcher(), ray_launcher_schema())
    _prepared_launcher()


@pytest.mark.parametrize("mutation", ["misspelled top-level key", "misspelled node type key", "wrong type"])
def test_mutated_cluster_launcher_fails_validation(mutation):
    bad = copy.deepcopy(_launcher())
    if mutation == "misspelled top-level key":
        bad["setup_comands"] = bad.pop("setup_commands")
    elif mutation == "misspelled node type key":
        bad["available_node_types"]["gpu"]["min_worker"] = bad["available_node_types"]["gpu"].pop("min_workers")
    else:
        bad["max_workers"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, ray_launcher_schema())


def test_cluster_launcher_keeps_ports_inside_the_security_group(monkeypatch):
    from ray.autoscaler._private.aws import config as aws_config
    cfg = _prepared_launcher()
    assert cfg["provider"]["type"] == "aws" and cfg["provider"]["use_internal_ips"] is True
    assert "security_group" not in cfg["provider"]          # no extra rules for Ray to add
    for name, node_type in cfg["available_node_types"].items():
        nics = node_type["node_config"]["NetworkInterfaces"]
        assert nics and all(n["AssociatePublicIpAddress"] is False and n["Groups"] for n in nics), name
    for keys, key, value in walk(cfg):
        assert not (isinstance(value, str) and ("0.0.0.0" in value or "::/0" in value)), (keys, key, value)
    # Ray's own bootstrap: with the groups given, it must neither create a group nor add rules (its
    # default group opens SSH to 0.0.0.0/0). Any AWS call here fails the test.
    cfg = aws_config._configure_from_network_interfaces(cfg)
    assert all(t["node_config"]["SecurityGroupIds"] for t in cfg["available_node_types"].values())

    def no_aws(*args, **kwargs):
        raise AssertionError("Ray would call AWS to create or change a security group")
    monkeypatch.setattr(aws_config, "_resource", no_aws)
    monkeypatch.setattr(aws_config, "_client", no_aws)
    aws_config._configure_security_group(cfg)


def test_cluster_launcher_token_auth_setup_and_versions():
    cfg = _prepared_launcher()
    mounts = cfg["file_mounts"]
    token_remote = next(r for r, local in mounts.items() if local.endswith("/.ray/auth_token"))
    (repo_remote,) = [r for r, local in mounts.items() if local == "."]      # `ray up` from the repo root
    assert (REPO / "scripts" / "setup.sh").is_file()
    setup = " ; ".join(cfg["setup_commands"])
    assert f"cd {repo_remote} && " in setup and "bash scripts/setup.sh" in setup
    pin = re.search(r"ray==(\d+\.\d+\.\d+)", setup).group(1)
    import ray
    assert pin == _dockerfile_args()["RAY_VERSION"] == ray.__version__   # the Ray these tests ran
    starts = [c for c in cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"] if " start " in f" {c} "]
    assert len(starts) == 2
    for cmd in starts:
        assert "RAY_AUTH_MODE=token" in cmd and f"RAY_AUTH_TOKEN_PATH={token_remote}" in cmd, cmd
        assert cmd.index("RAY_AUTH_MODE") < cmd.index("ray start")
        assert f"{repo_remote}/.venv/bin/ray start" in cmd                       # setup.sh's venv
        # Jobs submitted without --working-dir run in the cwd of `ray start`, with its PATH's python.
        assert f"cd {repo_remote};" in cmd and f"PATH={repo_remote}/.venv/bin:$PATH" in cmd
    (head_start,) = [c for c in cfg["head_start_ray_commands"] if "--head" in c]
    assert "--dashboard-host=127.0.0.1" in head_start and "--num-cpus=0" in head_start
    assert cfg["available_node_types"][cfg["head_node_type"]]["resources"] == {"CPU": 0}
    assert cfg["available_node_types"]["gpu"]["node_config"]["InstanceType"].startswith(("g", "p"))


# ---- 9. the RayJob's entrypoint, run locally ------------------------------------------------------
@pytest.mark.slow
def test_rayjob_entrypoint_runs_locally(ray_head, tiny_model_dir, tmp_path):
    """`python jobs/generate.py --config /config/job.yaml` exactly as the RayJob runs it (from the
    repo root = the image's /app), the config file being the ConfigMap's content. Overrides swap in
    what a laptop has instead of the GPU cluster: the tiny model on CPU, a 3-row local input, a local
    output dir, the test's Ray head, and 1 CPU per actor (the head has 4 CPUs, not 2 pods x 8)."""
    job, _, argv, text = rayjob_parts()
    config_file = tmp_path / "job.yaml"
    config_file.write_text(text)
    i = argv.index("--config") + 1
    command = [sys.executable, *argv[1:i], str(config_file), *argv[i + 1:]]
    assert argv[0] == "python" and command[1:i] == argv[1:i]
    rows = [{**r, "max_tokens": 6} for r in prompt_rows(3, "k")]     # short outputs: a per-row setting
    write_parquet(tmp_path / "in" / "prompts.parquet", rows)
    out = tmp_path / "out"
    overrides = [f"models.target={tiny_model_dir}", "models.device=cpu", "cluster.num_gpus_per_worker=0",
                 "cluster.num_cpus_per_worker=1", f"input.path={tmp_path / 'in'}", f"output.path={out}",
                 f"cluster.address={ray_head.address}"]
    proc = subprocess.run(command + overrides, cwd=REPO, env=os.environ.copy(), capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    run_dir = out / load_config(str(config_file), overrides).run.run_id
    assert (run_dir / "_SUCCESS").exists()
    assert manifest(run_dir)["completions"] == 3
    assert sorted(c["id"] for c in read_run(run_dir)["completions"]) == sorted(r["id"] for r in rows)
