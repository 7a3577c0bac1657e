"""Validate the manifests offline, with unknown fields rejected everywhere (a typo must fail).

    python manifests/validate.py [FILE.yaml ...]     # default: every manifests/*.yaml

What checks what:

* core kinds (Namespace, Secret, Deployment, DaemonSet, NetworkPolicy, ...): the Kubernetes
  OpenAPI schemas bundled in ``kubernetes-validate``, strict (``K8S_VERSION``, k3s's minor);
* RayCluster / RayService: the KubeRay v1.7.0 CRDs' ``openAPIV3Schema`` made strict
  (``additionalProperties: false`` on every object that lists its properties; the API server
  would silently prune an unknown field instead), the top-level ObjectMeta strictly, and the
  operator's own admission checks that no schema expresses (``operator_problems``);
* a RayService's ``serveConfigV2``: Ray Serve's ``ServeDeploySchema`` (its JSON schema made
  strict the same way, then the model itself for its cross-field checks);
* PodMonitor (prometheus-operator's CRD, not vendored here): ``PODMONITOR_SCHEMA``, the part of
  its schema the manifests use, strict, and its ObjectMeta as for the KubeRay kinds.

The CRDs are not in this repository (they are KubeRay's data files); they are read from
``$HIVE_KUBERAY_CRDS`` or ``../shared/crds`` beside the repository (``crd_dir``).
"""

from __future__ import annotations

import copy
import functools
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
K8S_VERSION = "1.34"  # the k3s minor manifests/README.md installs
KUBERAY_VERSION = "v1.7.0"
CRD_FILES = {"RayCluster": "ray.io_rayclusters.yaml", "RayService": "ray.io_rayservices.yaml"}
NAME_LIMITS = {"RayCluster": 53, "RayService": 47}  # the operator's limits (it derives longer names)
UPGRADE_TYPES = {"RayService": {"NewCluster", "NewClusterWithIncrementalUpgrade", "None"},
                 "RayCluster": {"Recreate", "None"}}
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


@dataclass
class Problem:
    file: str
    resource: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}: {self.resource}: {self.message}"


def crd_dir() -> Path | None:
    """Where the KubeRay CRD YAMLs are: $HIVE_KUBERAY_CRDS, else ../shared/crds; None if absent."""
    for candidate in (os.environ.get("HIVE_KUBERAY_CRDS"), ROOT.parent / "shared" / "crds"):
        if candidate and all((Path(candidate) / f).is_file() for f in CRD_FILES.values()):
            return Path(candidate)
    return None


def strict(schema: Any) -> Any:
    """A copy of a JSON schema in which every object that lists ``properties`` forbids others.

    Maps (``additionalProperties`` given) and free-form objects (no ``properties``, or
    ``x-kubernetes-preserve-unknown-fields``) stay open, as they are open in the API too.
    """
    schema = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


# prometheus-operator's PodMonitor (monitoring.coreos.com/v1): the fields of its CRD schema that
# manifests/podmonitor.yaml uses or may need, with the CRD's own types and patterns. Strict like the
# rest: a field missing here fails as a typo would (add it from the CRD when a manifest needs it).
_PROM_DURATION = {"type": "string",
                  "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
_PROM_LABEL = {"type": "string", "pattern": r"^[a-zA-Z_][a-zA-Z0-9_]*$"}
_RELABEL_ACTIONS = ["replace", "keep", "drop", "hashmod", "labelmap", "labeldrop", "labelkeep", "lowercase",
                    "uppercase", "keepequal", "dropequal"]
_RELABELINGS = {"type": "array", "items": {"type": "object", "properties": {
    "sourceLabels": {"type": "array", "items": _PROM_LABEL}, "separator": {"type": "string"},
    "targetLabel": {"type": "string"}, "regex": {"type": "string"}, "modulus": {"type": "integer"},
    "replacement": {"type": "string"},
    # the CRD takes each action in lower case and capitalised (HashMod, LabelMap, KeepEqual...)
    "action": {"type": "string", "pattern": "^(?i:" + "|".join(_RELABEL_ACTIONS) + ")$"}}}}
PODMONITOR_SCHEMA = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "PodMonitor"},
        "metadata": {"type": "object"},  # checked as Kubernetes ObjectMeta (validate_doc)
        "spec": {"type": "object", "required": ["selector"], "properties": {
            "selector": {"type": "object", "properties": {
                "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
                "matchExpressions": {"type": "array", "items": {
                    "type": "object", "required": ["key", "operator"], "properties": {
                        "key": {"type": "string"}, "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                        "values": {"type": "array", "items": {"type": "string"}}}}}}},
            "namespaceSelector": {"type": "object", "properties": {
                "any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}}},
            "jobLabel": {"type": "string"},
            "podTargetLabels": {"type": "array", "items": {"type": "string"}},
            "podMetricsEndpoints": {"type": "array", "items": {"type": "object", "properties": {
                "port": {"type": "string", "minLength": 1}, "path": {"type": "string"},
                "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                "interval": _PROM_DURATION, "scrapeTimeout": _PROM_DURATION,
                "honorLabels": {"type": "boolean"}, "honorTimestamps": {"type": "boolean"},
                "relabelings": _RELABELINGS, "metricRelabelings": _RELABELINGS}}}}}}}


@functools.lru_cache(maxsize=1)
def podmonitor_validator():
    import jsonschema

    return jsonschema.Draft202012Validator(strict(PODMONITOR_SCHEMA))


def _meta_problems(doc: dict) -> list[str]:
    """A custom resource's top-level ObjectMeta, checked strictly as Kubernetes checks it (a CRD's
    schema leaves it a bare object)."""
    import kubernetes_validate

    meta_only = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc.get("metadata") or {}}
    try:
        kubernetes_validate.validate(meta_only, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"metadata: {e.message}"]
    return []


@functools.cache
def crd_validator(kind: str, directory: str):
    import jsonschema

    crd = yaml.load((Path(directory) / CRD_FILES[kind]).read_text(encoding="utf-8"), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    schema = strict(version["schema"]["openAPIV3Schema"])
    schema["properties"]["apiVersion"] = {"const": "ray.io/v1"}
    schema["properties"]["kind"] = {"const": kind}
    schema["properties"].pop("status", None)  # written by the operator, never by a manifest
    schema["required"] = ["apiVersion", "kind", "metadata", "spec"]
    return jsonschema.Draft202012Validator(schema)


@functools.lru_cache(maxsize=1)
def serve_validator():
    import jsonschema
    from ray.serve.schema import ServeDeploySchema

    return jsonschema.Draft202012Validator(strict(ServeDeploySchema.model_json_schema()))


def _path(error) -> str:
    return ".".join(str(p) for p in error.absolute_path) or "(top)"


def serve_config_problems(config: Any) -> list[str]:
    """Ray Serve's deploy schema, strict, then its own model (duplicate routes, import paths, ...)."""
    problems = [f"{_path(e)}: {e.message}" for e in sorted(serve_validator().iter_errors(config), key=str)]
    if not problems:
        from pydantic import ValidationError
        from ray.serve.schema import ServeDeploySchema

        try:
            ServeDeploySchema.model_validate(config)
        except ValidationError as e:
            problems = [f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()]
    return problems


def _label_problems(where: str, labels: dict[str, Any]) -> Iterator[str]:
    for key, value in (labels or {}).items():
        prefix, _, name = str(key).rpartition("/")
        if (prefix and (len(prefix) > 253 or not _DNS1123_SUBDOMAIN.match(prefix))) or not (
                0 < len(name) <= 63 and _LABEL_NAME.match(name)):
            yield f"{where}: invalid label key {key!r}"
        if not isinstance(value, str) or len(value) > 63 or (value and not _LABEL_NAME.match(value)):
            yield f"{where}: invalid label value {value!r} for {key!r}"


def operator_problems(doc: dict) -> list[str]:
    """KubeRay v1.7.0's admission checks (``validation.go``) that its CRD schema does not encode."""
    kind, problems = doc["kind"], []
    name = doc.get("metadata", {}).get("name", "")
    if not _DNS1035.match(name) or len(name) > NAME_LIMITS[kind]:
        problems.append(f"metadata.name {name!r}: a DNS-1035 label of at most {NAME_LIMITS[kind]} characters")
    spec = doc.get("spec") or {}
    cluster = spec.get("rayClusterConfig", {}) if kind == "RayService" else spec
    base = "spec.rayClusterConfig" if kind == "RayService" else "spec"
    upgrade = (spec.get("upgradeStrategy") or {}).get("type")
    if upgrade is not None and upgrade not in UPGRADE_TYPES[kind]:
        problems.append(f"spec.upgradeStrategy.type {upgrade!r}: one of {sorted(UPGRADE_TYPES[kind])}")
    autoscaler_v2 = cluster.get("enableInTreeAutoscaling") and (cluster.get("autoscalerOptions") or {}).get("version", "v2") == "v2"
    groups = [("headGroupSpec", cluster.get("headGroupSpec") or {})] + [
        (f"workerGroupSpecs.{i}", g) for i, g in enumerate(cluster.get("workerGroupSpecs") or [])]
    names = [g.get("groupName") for _, g in groups[1:]]
    for dup in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"{base}.workerGroupSpecs: groupName {dup!r} appears twice")
    for where, group in groups:
        where = f"{base}.{where}"
        params = group.get("rayStartParams") or {}
        if "labels" in params:
            problems.append(f"{where}.rayStartParams.labels: not supported since KubeRay 1.5; use the group's labels field")
        if group.get("resources") and any(k in params for k in ("num-cpus", "num-gpus", "memory", "resources")):
            problems.append(f"{where}: resources in both rayStartParams and the resources field; use one")
        problems += list(_label_problems(f"{where}.labels", group.get("labels") or {}))
        pod = (group.get("template") or {}).get("spec") or {}
        if not pod.get("containers"):
            problems.append(f"{where}.template.spec.containers: at least one container (the first is Ray's)")
        if autoscaler_v2 and pod.get("restartPolicy") not in (None, "Never"):
            problems.append(f"{where}.template.spec.restartPolicy: autoscaler v2 needs Never or unset")
        if "redis-password" in params:
            problems.append(f"{where}.rayStartParams.redis-password: set gcsFaultToleranceOptions.redisPassword instead")
        for c in pod.get("containers") or []:
            for env in c.get("env") or []:
                if env.get("name") in ("RAY_REDIS_ADDRESS", "REDIS_PASSWORD") and cluster.get("gcsFaultToleranceOptions"):
                    problems.append(f"{where}: env {env['name']} conflicts with gcsFaultToleranceOptions")
        if where.endswith("headGroupSpec"):
            continue
        lo, hi, n = group.get("minReplicas"), group.get("maxReplicas"), group.get("replicas")
        if lo is None or hi is None:
            problems.append(f"{where}: minReplicas and maxReplicas are required")
        elif not 0 <= lo <= hi:
            problems.append(f"{where}: need 0 <= minReplicas ({lo}) <= maxReplicas ({hi})")
        elif n is not None and not lo <= n <= hi:
            problems.append(f"{where}: replicas ({n}) outside [minReplicas, maxReplicas]")
    head = cluster.get("headGroupSpec") or {}
    if kind == "RayService" and ((head.get("headService") or {}).get("metadata") or {}).get("name"):
        problems.append(f"{base}.headGroupSpec.headService.metadata.name: must not be set in a RayService")
    head_env = {e.get("name") for c in ((head.get("template") or {}).get("spec") or {}).get("containers", [])[:1]
                for e in c.get("env") or []}
    if "redis-username" in (head.get("rayStartParams") or {}) or "REDIS_USERNAME" in head_env:
        problems.append(f"{base}.headGroupSpec: set gcsFaultToleranceOptions.redisUsername, not redis-username / REDIS_USERNAME")
    if (spec.get("rayClusterDeletionDelaySeconds") or 0) < 0:
        problems.append("spec.rayClusterDeletionDelaySeconds: must be >= 0")
    gcs = cluster.get("gcsFaultToleranceOptions")
    if gcs:
        annotations = doc.get("metadata", {}).get("annotations") or {}
        if "ray.io/ft-enabled" in annotations:
            problems.append("metadata.annotations ray.io/ft-enabled: conflicts with gcsFaultToleranceOptions")
        if gcs.get("storage") and (gcs.get("redisAddress") or gcs.get("redisPassword")):
            problems.append(f"{base}.gcsFaultToleranceOptions: storage and Redis fields are exclusive")
        if gcs.get("backend", "redis") == "redis" and not gcs.get("redisAddress"):
            problems.append(f"{base}.gcsFaultToleranceOptions.redisAddress: required for the redis backend")
    return problems


def validate_doc(doc: dict, crds: Path | None) -> list[str]:
    """Every problem of one manifest document; [] when it passes."""
    import kubernetes_validate

    if not isinstance(doc, dict) or "kind" not in doc or "apiVersion" not in doc:
        return ["not a Kubernetes object (no apiVersion/kind)"]
    kind = doc["kind"]
    if doc["apiVersion"].startswith("ray.io/"):
        if kind not in CRD_FILES:
            return [f"{kind}: no CRD schema here (only {sorted(CRD_FILES)})"]
        if crds is None:
            raise FileNotFoundError("KubeRay CRDs not found: set HIVE_KUBERAY_CRDS or provide ../shared/crds")
        v = crd_validator(kind, str(crds))
        problems = [f"{_path(e)}: {e.message}" for e in sorted(v.iter_errors(doc), key=str)]
        problems += _meta_problems(doc)
        problems += operator_problems(doc)
        if kind == "RayService" and isinstance((doc.get("spec") or {}).get("serveConfigV2"), str):
            config = yaml.safe_load(doc["spec"]["serveConfigV2"])
            problems += [f"serveConfigV2: {p}" for p in serve_config_problems(config)]
        return problems
    if doc["apiVersion"].startswith("monitoring.coreos.com/"):
        if kind != "PodMonitor":
            return [f"{kind}: no schema here (only PodMonitor of monitoring.coreos.com)"]
        v = podmonitor_validator()
        return [f"{_path(e)}: {e.message}" for e in sorted(v.iter_errors(doc), key=str)] + _meta_problems(doc)
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{_path(e)}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError:
        return [f"no Kubernetes {K8S_VERSION} schema for {doc['apiVersion']} {kind}"]
    return []


def manifest_files() -> list[Path]:
    return sorted(HERE.glob("*.yaml"))


def validate_files(files: list[Path]) -> list[Problem]:
    crds = crd_dir()
    out = []
    for f in files:
        for doc in yaml.safe_load_all(f.read_text(encoding="utf-8")):
            if doc is None:
                continue
            resource = f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}" if isinstance(doc, dict) else "?"
            out += [Problem(f.name, resource, m) for m in validate_doc(doc, crds)]
    return out


def main(argv: list[str]) -> int:
    files = [Path(a) for a in argv] or manifest_files()
    if crd_dir() is None:
        print("KubeRay CRDs not found: set HIVE_KUBERAY_CRDS to a folder with "
              f"{', '.join(CRD_FILES.values())} (KubeRay {KUBERAY_VERSION})", file=sys.stderr)
        return 2
    problems = validate_files(files)
    for p in problems:
        print(f"FAIL {p}")
    print(f"{len(files)} files, {len(problems)} problems (Kubernetes {K8S_VERSION}, KubeRay {KUBERAY_VERSION}, strict)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
