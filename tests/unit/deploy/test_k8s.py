"""deploy/k8s: every overlay renders (deploy/k8s/render.py, kustomize's subset these files use), every rendered
manifest validates against the Kubernetes schemas (``kubernetes-validate``, offline, strict: an unknown
field is an error), and the promises docs/deploy.md makes hold: each role's probes on ``/health``, a drain
period covered by ``terminationGracePeriodSeconds``, GPU requests, no password in the files, settings that
load, scrape annotations on the metrics port, the dashboard in sync. The checks are shown to catch planted
mistakes."""

from __future__ import annotations

import copy
import importlib.util
import json
import re

import kubernetes_validate
import pytest
import yaml

from services.settings import SETTINGS, CommonSettings, load_settings
from tests.unit.deploy.conftest import ROOT

K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("one-gpu", "gpu8", "two-nodes")
# The oldest Kubernetes these files claim (the PodLifecycle and probe fields they use are older) and the newest
# schema kubernetes-validate carries.
VERSIONS = ("1.30.0", kubernetes_validate.utils.latest_version())
ENGINES = {"one-gpu": (1, 1), "gpu8": (2, 6), "two-nodes": (4, 12)}  # prefill, decode replicas
ROLE_OF = {"eyrie-router": "router", "eyrie-prefill": "prefill", "eyrie-decode": "decode"}


def load_render():
    spec = importlib.util.spec_from_file_location("k8s_render", K8S / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = load_render()


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request) -> tuple[str, list[dict]]:
    return request.param, render.build(K8S / "overlays" / request.param)


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def pod_env(docs: list[dict], workload: dict) -> dict[str, str]:
    """The container's environment as the pod sees it: its ConfigMaps (envFrom), then its own ``env`` (literal
    values; ``$(VAR)`` expanded from what came before; references to secrets and fields left as ``<ref>``)."""
    maps = by_kind(docs, "ConfigMap")
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(maps[source["configMapRef"]["name"]]["data"])
    for var in container.get("env", []):
        value = var.get("value", "<ref>")
        env[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), value)
    return env


def complaints(docs: list[dict]) -> list[str]:
    """What breaks docs/deploy.md's promises in one overlay's manifests (empty when nothing does)."""
    out = []
    for name, w in {**by_kind(docs, "Deployment"), **by_kind(docs, "StatefulSet")}.items():
        pod = w["spec"]["template"]["spec"]
        for c in pod["containers"]:
            for probe in ("readinessProbe", "livenessProbe"):
                if probe not in c:
                    out.append(f"{name}/{c['name']}: no {probe}")
        if name not in ROLE_OF:
            continue
        out += eyrie_complaints(docs, name, w)
    for name, svc in by_kind(docs, "Service").items():
        pods = [w for w in [*by_kind(docs, "Deployment").values(), *by_kind(docs, "StatefulSet").values()]
                if svc["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        if not pods:
            out.append(f"service {name}: selects no pod")
        ports = {p["name"] for w in pods for c in w["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        out += [f"service {name}: target port {p['targetPort']} is no container's" for p in svc["spec"]["ports"]
                if p["targetPort"] not in ports]
    return out


def eyrie_complaints(docs: list[dict], name: str, w: dict) -> list[str]:
    out, pod = [], w["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    env = pod_env(docs, w)
    drain = float(env.get("EYRIE_DRAIN_TIMEOUT_S", CommonSettings.model_fields["drain_timeout_s"].default))
    pause = float(c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", ["", "0"])[-1])
    if "preStop" not in c.get("lifecycle", {}):
        out.append(f"{name}: no preStop hook")
    grace = pod.get("terminationGracePeriodSeconds", 30)
    if grace < pause + drain:
        out.append(f"{name}: terminationGracePeriodSeconds {grace} < preStop {pause} s + drain {drain} s")
    http_port = env.get("EYRIE_HTTP_PORT")
    named = {p["name"]: p["containerPort"] for p in c["ports"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = c.get(probe, {}).get("httpGet", {})
        if get.get("path") != "/health" or str(named.get(get.get("port"), get.get("port"))) != http_port:
            out.append(f"{name}: {probe} is not /health on EYRIE_HTTP_PORT {http_port}")
    live = c.get("livenessProbe", {})
    if live.get("periodSeconds", 10) * live.get("failureThreshold", 3) <= drain:
        out.append(f"{name}: the liveness probe gives up before the drain ({drain} s) ends")
    notes = w["spec"]["template"]["metadata"].get("annotations", {})
    if notes.get("prometheus.io/scrape") != "true" or notes.get("prometheus.io/port") != http_port:
        out.append(f"{name}: no Prometheus scrape annotations on the metrics port {http_port}")
    url = env.get("EYRIE_REDIS_URL", "")
    if not re.fullmatch(r"redis://:<ref>@[\w.-]+:\d+/\d+", url):
        out.append(f"{name}: EYRIE_REDIS_URL {url!r} does not take its password from the secret")
    if ROLE_OF[name] != "router" and c["resources"]["limits"].get("nvidia.com/gpu", 0) < 1:
        out.append(f"{name}: no nvidia.com/gpu limit")
    return out


@pytest.mark.parametrize("version", VERSIONS)
def test_every_rendered_manifest_validates_against_the_kubernetes_schemas(overlay, version):
    name, docs = overlay
    assert {d["kind"] for d in docs} >= {"Deployment", "StatefulSet", "Service", "ConfigMap",
                                          "PersistentVolumeClaim", "PodDisruptionBudget"}
    for d in docs:
        kubernetes_validate.validate(d, version, strict=True)  # raises naming the field
        assert d["metadata"]["namespace"] == "eyrie"


def test_the_schema_check_catches_a_misspelt_field(overlay):
    _, docs = overlay
    bad = copy.deepcopy(by_kind(docs, "Deployment")["eyrie-decode"])
    bad["spec"]["template"]["spec"]["containers"][0]["livenessprobe"] = bad["spec"]["template"]["spec"][
        "containers"][0].pop("livenessProbe")
    with pytest.raises(kubernetes_validate.utils.ValidationError, match="livenessprobe"):
        kubernetes_validate.validate(bad, VERSIONS[-1], strict=True)


def test_every_role_keeps_the_promises(overlay):
    name, docs = overlay
    assert complaints(docs) == []
    deployments = by_kind(docs, "Deployment")
    assert set(deployments) == set(ROLE_OF)
    assert deployments["eyrie-router"]["spec"]["replicas"] >= 2
    assert (deployments["eyrie-prefill"]["spec"]["replicas"], deployments["eyrie-decode"]["spec"]["replicas"]) == \
        ENGINES[name]
    for role in ("eyrie-prefill", "eyrie-decode"):
        res = deployments[role]["spec"]["template"]["spec"]["containers"][0]["resources"]
        assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == 1
        assert deployments[role]["spec"]["template"]["spec"]["containers"][0]["args"] == \
            ["eyrie", "serve", ROLE_OF[role]]
    router = by_kind(docs, "Service")["eyrie-router"]
    assert {p["name"]: p["port"] for p in router["spec"]["ports"]} == {"grpc": 50051, "openai": 8000}


def test_the_checks_catch_planted_mistakes(overlay):
    _, docs = overlay

    def planted(change) -> list[str]:
        d = copy.deepcopy(docs)
        change(by_kind(d, "Deployment"), by_kind(d, "ConfigMap"))
        return complaints(d)

    def engine(deps, role="eyrie-decode"):
        return deps[role]["spec"]["template"]["spec"]["containers"][0]

    assert any("terminationGracePeriodSeconds" in c for c in planted(
        lambda deps, maps: maps["eyrie-common"]["data"].update(EYRIE_DRAIN_TIMEOUT_S="120")))
    assert any("terminationGracePeriodSeconds" in c for c in planted(
        lambda deps, maps: deps["eyrie-router"]["spec"]["template"]["spec"].pop("terminationGracePeriodSeconds")))
    assert any("no readinessProbe" in c for c in planted(lambda deps, maps: engine(deps).pop("readinessProbe")))
    assert any("livenessProbe is not /health" in c for c in planted(
        lambda deps, maps: engine(deps, "eyrie-prefill")["livenessProbe"]["httpGet"].update(port=50051)))
    assert any("gives up before the drain" in c for c in planted(
        lambda deps, maps: engine(deps)["livenessProbe"].update(failureThreshold=2)))
    assert any("no preStop" in c for c in planted(lambda deps, maps: engine(deps).pop("lifecycle")))
    assert any("password from the secret" in c for c in planted(
        lambda deps, maps: engine(deps)["env"].append({"name": "EYRIE_REDIS_URL",
                                                       "value": "redis://:eyrie-local@eyrie-redis:6379/0"})))
    assert any("nvidia.com/gpu" in c for c in planted(
        lambda deps, maps: engine(deps)["resources"]["limits"].pop("nvidia.com/gpu")))
    assert any("selects no pod" in c for c in planted(
        lambda deps, maps: deps["eyrie-router"]["spec"]["template"]["metadata"]["labels"].update(
            {"app.kubernetes.io/name": "other"})))


def test_no_password_ships_in_the_files(overlay):
    _, docs = overlay
    assert by_kind(docs, "Secret") == {}  # the operator creates eyrie-redis (docs/deploy.md)
    redis = by_kind(docs, "StatefulSet")["eyrie-redis"]["spec"]["template"]["spec"]["containers"][0]
    refs = {v["name"]: v.get("valueFrom", {}).get("secretKeyRef") for v in redis["env"]}
    assert refs["REDIS_PASSWORD"] == {"name": "eyrie-redis", "key": "password"}
    assert '--requirepass "$REDIS_PASSWORD"' in redis["command"][-1]
    for name in ROLE_OF:
        env = by_kind(docs, "Deployment")[name]["spec"]["template"]["spec"]["containers"][0]["env"]
        assert {"name": "REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {"name": "eyrie-redis", "key": "password"}}} \
            in env
    text = yaml.safe_dump_all(docs)
    assert "eyrie-local" not in text and "requirepass eyrie" not in text


def test_every_eyrie_variable_is_a_setting_of_its_role_and_loads(overlay, monkeypatch):
    _, docs = overlay
    for name, role in ROLE_OF.items():
        env = pod_env(docs, by_kind(docs, "Deployment")[name])
        eyrie = {k: v.replace("<ref>", "secret") for k, v in env.items() if k.startswith("EYRIE_")}
        known = {f"EYRIE_{f.upper()}" for f in SETTINGS[role].model_fields}
        assert set(eyrie) - {"EYRIE_ADVERTISE_HOST"} <= known, f"{name}: {sorted(set(eyrie) - known)}"
        with monkeypatch.context() as m:
            for k, v in eyrie.items():
                m.setenv(k, v)
            settings = load_settings(role)
        assert settings.host == "0.0.0.0" and settings.http_port == 8080 and settings.grpc_port == 50051
        assert settings.model == "/models/target"
        if role != "router":
            assert settings.device == "cuda" and settings.draft == "/models/eagle3"
    transfer = by_kind(docs, "ConfigMap")["eyrie-transfer"]["data"]
    assert set(transfer) >= {"UCX_TLS", "UCX_NET_DEVICES"}


def test_two_nodes_spread_each_role_evenly():
    docs = render.build(K8S / "overlays" / "two-nodes")
    for name in ("eyrie-prefill", "eyrie-decode"):
        (spread,) = by_kind(docs, "Deployment")[name]["spec"]["template"]["spec"]["topologySpreadConstraints"]
        assert spread["topologyKey"] == "kubernetes.io/hostname" and spread["maxSkew"] == 1
        assert spread["whenUnsatisfiable"] == "DoNotSchedule"
        assert spread["labelSelector"] == {"matchLabels": {"app.kubernetes.io/name": name}}
    env = pod_env(docs, by_kind(docs, "Deployment")["eyrie-prefill"])
    assert env["EYRIE_HANDOFF_STREAMS"] == "4"
    assert "EYRIE_HANDOFF_STREAMS" not in pod_env(docs, by_kind(docs, "Deployment")["eyrie-decode"])


def test_the_dashboard_configmap_is_docs_dashboard():
    assert (K8S / "base" / "grafana-dashboard.yaml").read_text() == render.dashboard_configmap(), \
        "stale: run python deploy/k8s/render.py --write-dashboard"
    (cm,) = [d for d in render.build(K8S / "base") if d["metadata"]["name"] == "eyrie-grafana-dashboard"]
    assert json.loads(cm["data"]["eyrie.json"]) == json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"


# ---- the renderer ---------------------------------------------------------------------------------
def test_strategic_merge_merges_lists_by_their_keys_and_replaces_others():
    base = {"spec": {"containers": [{"name": "a", "image": "x", "env": [{"name": "K", "value": "1"}],
                                     "args": ["p", "q"]}, {"name": "b", "image": "y"}],
                     "tolerations": [{"key": "t1"}], "drop": 1}}
    patch = {"spec": {"containers": [{"name": "a", "env": [{"name": "K", "value": "2"}, {"name": "L", "value": "3"}],
                                      "args": ["r"]}, {"name": "b", "$patch": "delete"}, {"name": "c", "image": "z"}],
                      "tolerations": [{"key": "t2"}], "drop": None}}
    out = render.merge(base, patch)
    assert out == {"spec": {"containers": [
        {"name": "a", "image": "x", "env": [{"name": "K", "value": "2"}, {"name": "L", "value": "3"}], "args": ["r"]},
        {"name": "c", "image": "z"}], "tolerations": [{"key": "t2"}]}}
    assert base["spec"]["containers"][0]["env"] == [{"name": "K", "value": "1"}]  # the base is left as it was


def write_kustomization(path, **fields):
    path.mkdir(parents=True, exist_ok=True)
    (path / "kustomization.yaml").write_text(yaml.safe_dump(fields))


def test_renderer_patches_by_target_deletes_sets_images_and_refuses_what_it_does_not_render(tmp_path):
    write_kustomization(tmp_path / "o", resources=[str(K8S / "base")], namespace="n",
                        images=[{"name": "eyrie-cuda", "newName": "reg.example/eyrie-cuda", "newTag": "9"}],
                        patches=[{"patch": "{kind: StatefulSet, metadata: {name: eyrie-redis}, $patch: delete}"},
                                 {"path": "p.yaml", "target": {"kind": "Deployment", "name": "eyrie-decode"}}])
    (tmp_path / "o" / "p.yaml").write_text(yaml.safe_dump(
        {"kind": "Deployment", "metadata": {"name": "any"}, "spec": {"replicas": 3}}))
    docs = render.build(tmp_path / "o")
    assert "eyrie-redis" not in by_kind(docs, "StatefulSet")
    deps = by_kind(docs, "Deployment")
    assert deps["eyrie-decode"]["spec"]["replicas"] == 3 and deps["eyrie-prefill"]["spec"]["replicas"] == 1
    assert deps["eyrie-decode"]["spec"]["template"]["spec"]["containers"][0]["image"] == "reg.example/eyrie-cuda:9"
    assert deps["eyrie-router"]["spec"]["template"]["spec"]["containers"][0]["image"] == "eyrie-cpu:0.1.0"
    write_kustomization(tmp_path / "u", resources=[str(K8S / "base")], configMapGenerator=[{"name": "x"}])
    with pytest.raises(render.RenderError, match="configMapGenerator"):
        render.build(tmp_path / "u")
    write_kustomization(tmp_path / "m", resources=[str(K8S / "base")],
                        patches=[{"patch": "{kind: Deployment, metadata: {name: nobody}, spec: {replicas: 2}}"}])
    with pytest.raises(render.RenderError, match="matches no resource"):
        render.build(tmp_path / "m")


def test_render_command_prints_the_overlay(capsys):
    assert render.main(["gpu8"]) == 0
    docs = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    assert docs == render.build(K8S / "overlays" / "gpu8")
    assert render.main(["no-such-overlay"]) == 2
    assert "no kustomization.yaml" in capsys.readouterr().err
