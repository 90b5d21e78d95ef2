"""The GPU profiles of docker-compose.yml (gpu: one GPU shared; gpu2 (1P1D); gpu4 (1P3D); gpu8; gpu4-tp and
gpu8-tp: engines split over two GPUs): each validates, pins every engine to one GPU per tensor-parallel rank,
keeps engines that share a GPU within its memory, and starts its router after all its engines;
docker/check_gpus.py, which checks that, catches the planted mistakes."""

from __future__ import annotations

import functools
import importlib.util
import os
import sys

import pytest

from tests.unit.deploy.conftest import ROOT, compose_config, environment, role_of, run_compose_config

# Each profile's engines and the GPUs each reserves (one per tensor-parallel rank).
PROFILES = {"gpu": {"prefill": ["0"], "decode": ["0"]},
            "gpu2": {"prefill-gpu2": ["0"], "decode-gpu2": ["1"]},
            "gpu4": {"prefill-gpu4-0": ["0"], **{f"decode-gpu4-{i}": [str(i)] for i in (1, 2, 3)}},
            "gpu8": {"prefill-gpu8-0": ["0"], "prefill-gpu8-1": ["1"],
                     **{f"decode-gpu8-{i}": [str(i)] for i in range(2, 8)}},
            "gpu4-tp": {"prefill-gpu4-tp": ["0", "1"], "decode-gpu4-tp": ["2", "3"]},
            "gpu8-tp": {"prefill-gpu8-tp-0-1": ["0", "1"],
                        **{f"decode-gpu8-tp-{i}-{i + 1}": [str(i), str(i + 1)] for i in (2, 4, 6)}}}
DEDICATED = ("gpu2", "gpu4", "gpu8", "gpu4-tp", "gpu8-tp")  # a GPU to each engine (rank)
SPLIT = ("gpu4-tp", "gpu8-tp")


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


def tensor_parallel(service: dict) -> int:
    return int(environment(service).get("EYRIE_TENSOR_PARALLEL") or 1)


@pytest.mark.parametrize("profile", [*PROFILES, "cpu"], ids=lambda p: f"profile-{p}")  # not "gpu": a marker
def test_each_profile_validates(profile):
    proc = run_compose_config(profiles=(profile,))
    assert proc.returncode == 0, proc.stderr
    assert "WARNING" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: f"profile-{p}")
def test_each_gpu_profile_pins_every_engine_to_its_gpu(profile):
    services = in_profile(compose_config()["services"], profile)
    engines = {n: s for n, s in services.items() if role_of(s) in ("prefill", "decode")}
    assert {n: device_ids(s) for n, s in engines.items()} == PROFILES[profile]
    for name, svc in engines.items():
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"] and "count" not in device, name
        assert environment(svc)["EYRIE_DEVICE"] == "cuda", name  # the container sees its GPUs as cuda:0 ..
        assert tensor_parallel(svc) == len(device_ids(svc)), name  # rank r on the r-th GPU it reserves
    assert check_gpus().problems(compose_config(), profile) == []
    # One router and the shared redis; the router waits for every engine of its profile.
    routers = [n for n, s in services.items() if role_of(s) == "router"]
    assert len(routers) == 1 and "redis" in services
    assert set(services[routers[0]]["depends_on"]) == {"redis", *engines}


def test_dedicated_gpus_are_distinct_and_take_the_default_fraction():
    services = compose_config()["services"]
    for profile in DEDICATED:
        ids = [g for n in PROFILES[profile] for g in device_ids(services[n])]
        assert len(ids) == len(set(ids)), (profile, ids)
        for name in PROFILES[profile]:
            assert environment(services[name])["EYRIE_GPU_MEMORY_FRACTION"] == "", name
    roles = [role_of(services[n]) for n in PROFILES["gpu8"]]
    assert roles.count("prefill") == 2 and roles.count("decode") == 6
    roles = [role_of(services[n]) for n in PROFILES["gpu8-tp"]]
    assert roles.count("prefill") == 1 and roles.count("decode") == 3
    assert sorted(g for n in PROFILES["gpu8-tp"] for g in device_ids(services[n])) == [str(i) for i in range(8)]


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


# ---- split engines (tensor parallelism) ---------------------------------------------------------------
def _shm_bytes(size) -> int:
    """Compose's shm_size (bytes, or a number with b/k/m/g, optionally followed by b) in bytes."""
    text = str(size).lower().removesuffix("b")
    unit = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("kmg")) * unit


@pytest.mark.parametrize("profile", SPLIT, ids=lambda p: f"profile-{p}")
def test_split_engines_load_as_tensor_parallel_services_with_ncclready_containers(profile, monkeypatch):
    """Each split service's settings ask for as many ranks as it reserves GPUs, and its container has what NCCL
    needs between the ranks inside it: a /dev/shm of 1 GB or more and unlimited locked memory."""
    from services.settings import load_settings

    services = compose_config()["services"]
    for name, gpus in PROFILES[profile].items():
        svc = services[name]
        for k in [k for k in os.environ if k.startswith("EYRIE_")]:
            monkeypatch.delenv(k)
        for k, v in environment(svc).items():
            if k.startswith("EYRIE_") and v:  # as the entrypoint does: empty = the default
                monkeypatch.setenv(k, v)
        settings = load_settings(role_of(svc))
        assert settings.tensor_parallel == len(gpus) == 2 and settings.engine_config().tensor_parallel == 2, name
        assert settings.device == "cuda", name  # ranks on cuda:0 and cuda:1, the two GPUs the container sees
        assert _shm_bytes(svc["shm_size"]) >= 1 << 30, (name, svc["shm_size"])
        assert svc["ulimits"]["memlock"] in (-1, {"soft": -1, "hard": -1}), (name, svc["ulimits"])
        assert svc["healthcheck"]["start_period"] in ("20m", "1200s"), name  # every rank reads the checkpoint
    assert check_gpus().problems(compose_config(), profile) == []


def test_a_split_engine_whose_gpu_count_differs_from_its_ranks_is_caught():
    config = compose_config()
    services = config["services"]
    services["decode-gpu4-tp"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] = ["2"]
    assert check_gpus().problems(config, "gpu4-tp") == [
        "decode-gpu4-tp: reserves 1 GPU (2) but runs 2 tensor-parallel ranks (EYRIE_TENSOR_PARALLEL): one GPU each"]
    # The same service at tensor parallel 1 is a plan: prefill and decode may be split differently.
    services["decode-gpu4-tp"]["environment"]["EYRIE_TENSOR_PARALLEL"] = "1"
    assert check_gpus().problems(config, "gpu4-tp") == []
    # Four ranks on two GPUs, a single-GPU profile's engine told to split, a size that is no number, a GPU twice.
    services["prefill-gpu8-tp-0-1"]["environment"]["EYRIE_TENSOR_PARALLEL"] = "4"
    services["decode-gpu8-tp-4-5"]["environment"]["EYRIE_TENSOR_PARALLEL"] = "two"
    services["decode-gpu8-tp-6-7"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] = ["6", "6"]
    assert check_gpus().problems(config, "gpu8-tp") == [
        "decode-gpu8-tp-4-5: EYRIE_TENSOR_PARALLEL='two' is not a positive integer",
        "decode-gpu8-tp-6-7: names GPU 6 twice in device_ids (one GPU per tensor-parallel rank)",
        "prefill-gpu8-tp-0-1: reserves 2 GPUs (0, 1) but runs 4 tensor-parallel ranks (EYRIE_TENSOR_PARALLEL): "
        "one GPU each"]
    services["decode-gpu2"]["environment"]["EYRIE_TENSOR_PARALLEL"] = "2"
    (problem,) = check_gpus().problems(config, "gpu2")
    assert problem.startswith("decode-gpu2: reserves 1 GPU (1) but runs 2 tensor-parallel ranks"), problem


def test_split_engines_sharing_a_gpu_are_bounded_per_gpu():
    config = compose_config()
    services = config["services"]
    services["decode-gpu4-tp"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] = ["1", "2"]
    (problem,) = check_gpus().problems(config, "gpu4-tp")  # GPU 1 only: GPU 2 is decode's alone
    assert problem.startswith("GPU 1 is shared by decode-gpu4-tp, prefill-gpu4-tp, but") and \
        "EYRIE_GPU_MEMORY_FRACTION" in problem, problem
    for name in ("prefill-gpu4-tp", "decode-gpu4-tp"):
        services[name]["environment"]["EYRIE_GPU_MEMORY_FRACTION"] = "0.45"
    assert check_gpus().problems(config, "gpu4-tp") == []
    services["decode-gpu4-tp"]["environment"]["EYRIE_GPU_MEMORY_FRACTION"] = "0.6"
    assert check_gpus().problems(config, "gpu4-tp") == [
        "GPU 1 is shared by decode-gpu4-tp, prefill-gpu4-tp, whose memory fractions sum to 1.05 (> 1)"]
    # Two decode groups on the same pair: both GPUs are shared, each named once.
    config = compose_config()
    config["services"]["decode-gpu8-tp-4-5"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] = \
        ["2", "3"]
    found = check_gpus().problems(config, "gpu8-tp")
    assert [p.split(" is shared by ")[0] for p in found] == ["GPU 2", "GPU 3"], found
    assert all("decode-gpu8-tp-2-3, decode-gpu8-tp-4-5, but" in p for p in found), found
    # Scaled replicas of a split service share all of its GPUs.
    found = check_gpus().problems(compose_config(), "gpu8-tp", {"decode-gpu8-tp-6-7": 2})
    assert [p.split(", but")[0] for p in found] == ["GPU 6 is shared by decode-gpu8-tp-6-7 x2",
                                                     "GPU 7 is shared by decode-gpu8-tp-6-7 x2"], found


def test_check_gpus_prints_each_split_engines_gpus(tmp_path, capsys):
    import yaml

    path = tmp_path / "resolved.yml"
    path.write_text(yaml.safe_dump(compose_config()))
    assert check_gpus().main(["--profile", "gpu8-tp", str(path)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "GPUs 0,1: prefill-gpu8-tp-0-1 (prefill) x1, tensor parallel 2, memory fraction 0.9 (default) per GPU",
        "GPUs 2,3: decode-gpu8-tp-2-3 (decode) x1, tensor parallel 2, memory fraction 0.9 (default) per GPU",
        "GPUs 4,5: decode-gpu8-tp-4-5 (decode) x1, tensor parallel 2, memory fraction 0.9 (default) per GPU",
        "GPUs 6,7: decode-gpu8-tp-6-7 (decode) x1, tensor parallel 2, memory fraction 0.9 (default) per GPU"]
