"""The GPU profiles of docker-compose.yml (gpu: one GPU shared; gpu2; gpu8): each validates, pins every engine
to one GPU, keeps engines that share a GPU within its memory, and starts its router after all its engines;
docker/check_gpus.py, which checks that, catches the planted mistakes."""

from __future__ import annotations

import functools
import importlib.util
import os
import sys

import pytest

from tests.unit.deploy.conftest import ROOT, compose_config, environment, role_of, run_compose_config

PROFILES = {"gpu": {"prefill": "0", "decode": "0"},
            "gpu2": {"prefill-gpu2": "0", "decode-gpu2": "1"},
            "gpu8": {"prefill-gpu8-0": "0", "prefill-gpu8-1": "1", **{f"decode-gpu8-{i}": str(i) for i in range(2, 8)}}}


@functools.cache
def check_gpus():
    """docker/check_gpus.py (a script, not a package module), loaded once."""
    spec = importlib.util.spec_from_file_location("check_gpus", ROOT / "docker" / "check_gpus.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves annotations through the module
    spec.loader.exec_module(module)
    return module


def in_profile(services: dict, profile: str) -> dict:
    return {n: s for n, s in services.items() if profile in s.get("profiles", [profile])}


def device_ids(service: dict) -> list[str]:
    return service["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]


@pytest.mark.parametrize("profile", [*PROFILES, "cpu"], ids=lambda p: f"profile-{p}")  # not "gpu": a marker
def test_each_profile_validates(profile):
    proc = run_compose_config(profiles=(profile,))
    assert proc.returncode == 0, proc.stderr
    assert "WARNING" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: f"profile-{p}")
def test_each_gpu_profile_pins_every_engine_to_its_gpu(profile):
    services = in_profile(compose_config()["services"], profile)
    engines = {n: s for n, s in services.items() if role_of(s) in ("prefill", "decode")}
    assert {n: device_ids(s) for n, s in engines.items()} == {n: [g] for n, g in PROFILES[profile].items()}
    for name, svc in engines.items():
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"] and "count" not in device, name
        assert environment(svc)["EYRIE_DEVICE"] == "cuda", name  # the container sees its one GPU as cuda:0
    assert check_gpus().problems(compose_config(), profile) == []
    # One router and the shared redis; the router waits for every engine of its profile.
    routers = [n for n, s in services.items() if role_of(s) == "router"]
    assert len(routers) == 1 and "redis" in services
    assert set(services[routers[0]]["depends_on"]) == {"redis", *engines}


def test_dedicated_gpus_are_distinct_and_take_the_default_fraction():
    services = compose_config()["services"]
    for profile in ("gpu2", "gpu8"):
        ids = [g for n in PROFILES[profile] for g in device_ids(services[n])]
        assert len(ids) == len(set(ids)), (profile, ids)
        for name in PROFILES[profile]:
            assert environment(services[name])["EYRIE_GPU_MEMORY_FRACTION"] == "", name
    roles = [role_of(services[n]) for n in PROFILES["gpu8"]]
    assert roles.count("prefill") == 2 and roles.count("decode") == 6


def test_the_shared_gpu_profile_splits_the_memory(monkeypatch):
    from services.settings import load_settings

    services = compose_config()["services"]
    fractions = {}
    for name in ("prefill", "decode"):
        for k in [k for k in os.environ if k.startswith("EYRIE_")]:
            monkeypatch.delenv(k)
        for k, v in environment(services[name]).items():
            if k.startswith("EYRIE_") and v:
                monkeypatch.setenv(k, v)
        fractions[name] = load_settings(name).gpu_memory_fraction
    assert fractions == {"prefill": 0.45, "decode": 0.45}
    moved = compose_config({"PREFILL_GPU_MEMORY_FRACTION": "0.3", "DECODE_GPU_MEMORY_FRACTION": "0.6"})["services"]
    assert environment(moved["prefill"])["EYRIE_GPU_MEMORY_FRACTION"] == "0.3"
    assert environment(moved["decode"])["EYRIE_GPU_MEMORY_FRACTION"] == "0.6"
    assert check_gpus().problems(compose_config(), "gpu") == []


# ---- the check catches planted mistakes ---------------------------------------------------------------
def test_two_engines_on_one_gpu_without_fractions_are_caught():
    config = compose_config()
    config["services"]["decode-gpu2"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] = ["0"]
    (problem,) = check_gpus().problems(config, "gpu2")
    assert "GPU 0 is shared by decode-gpu2, prefill-gpu2" in problem and "EYRIE_GPU_MEMORY_FRACTION" in problem
    # Each bounded, the same plan holds; the fractions must fit the GPU together.
    for name, fraction in (("prefill-gpu2", "0.4"), ("decode-gpu2", "0.5")):
        config["services"][name]["environment"]["EYRIE_GPU_MEMORY_FRACTION"] = fraction
    assert check_gpus().problems(config, "gpu2") == []
    config["services"]["decode-gpu2"]["environment"]["EYRIE_GPU_MEMORY_FRACTION"] = "0.7"
    assert check_gpus().problems(config, "gpu2") == [
        "GPU 0 is shared by decode-gpu2, prefill-gpu2, whose memory fractions sum to 1.10 (> 1)"]


def test_fractions_over_the_gpu_and_scaled_replicas_are_caught():
    over = compose_config({"DECODE_GPU_MEMORY_FRACTION": "0.7"})
    assert check_gpus().problems(over, "gpu") == [
        "GPU 0 is shared by decode, prefill, whose memory fractions sum to 1.15 (> 1)"]
    # --scale decode=2 puts a second replica on the same reservation.
    (problem,) = check_gpus().problems(compose_config(), "gpu", {"decode": 2})
    assert "decode x2" in problem and "1.35" in problem
    (problem,) = check_gpus().problems(compose_config(), "gpu8", {"decode-gpu8-5": 2})
    assert problem.startswith("GPU 5 is shared by decode-gpu8-5 x2") and "EYRIE_GPU_MEMORY_FRACTION" in problem
    # Two GPUs apart, the shared profile's fractions are merely conservative.
    assert check_gpus().problems(compose_config({"DECODE_GPU": "1", "DECODE_GPU_MEMORY_FRACTION": "0.9"}), "gpu") == []


def test_a_reservation_of_several_or_unnamed_gpus_and_a_schema_mismatch_are_caught():
    config = compose_config()
    services = config["services"]
    services["prefill-gpu8-0"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] = ["0", "1"]
    del services["decode-gpu8-3"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
    services["decode-gpu8-3"]["deploy"]["resources"]["reservations"]["devices"][0]["count"] = 1
    services["decode-gpu8-7"]["environment"]["EYRIE_PAGE_SIZE"] = "32"
    found = check_gpus().problems(config, "gpu8")
    assert any(p.startswith("prefill-gpu8-0: reserves 2 GPUs (0, 1)") for p in found), found
    assert any(p.startswith("decode-gpu8-3: count: 1 instead of device_ids") for p in found), found
    assert any(p.startswith("decode-gpu8-3: reserves 0 GPUs") for p in found), found
    assert any("decode-gpu8-7 and decode-gpu8-2 disagree on EYRIE_PAGE_SIZE" in p for p in found), found
    assert len(found) == 4, found


def test_check_gpus_command_line(tmp_path, capsys):
    import yaml

    path = tmp_path / "resolved.yml"
    path.write_text(yaml.safe_dump(compose_config()))
    assert check_gpus().main(["--profile", "gpu2", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["GPU 0: prefill-gpu2 (prefill) x1, memory fraction 0.9 (default)",
                   "GPU 1: decode-gpu2 (decode) x1, memory fraction 0.9 (default)"]
    assert check_gpus().main(["--profile", "gpu", "--scale", "prefill=2", str(path)]) == 1
    assert "prefill x2" in capsys.readouterr().out
    assert check_gpus().main(["--profile", "nonesuch", str(path)]) == 1
    assert capsys.readouterr().out.strip() == "profile nonesuch: no prefill or decode service"
