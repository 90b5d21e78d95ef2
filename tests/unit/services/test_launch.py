"""``eyrie serve | up | client``: bad input exits 2 with one line naming the problem, before starting anything."""

from __future__ import annotations

import json

import pytest

from services.cli import main


def run(capsys, *argv) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    err = capsys.readouterr().err
    return exc.value.code, err


@pytest.mark.parametrize("argv, words", [
    (["serve", "decode", "--model", "m", "--page-size", "four"], "page_size:"),
    (["serve", "prefill"], "model: give --model"),
    (["serve", "router", "--model", "/does/not/exist"], "no config.json"),
    (["serve", "router", "--no-such-flag", "1"], "unrecognized arguments"),
    (["serve", "gateway"], "invalid choice"),
    (["up", "--model", "/does/not/exist"], "--model: /does/not/exist is not a checkpoint directory"),
    (["up", "--decode", "0"], "at least 1 instance"),
    (["client", "hi", "--stop-token-ids", "1,x"], "--stop-token-ids"),
])
def test_bad_input_exits_2_with_one_line(capsys, argv, words):
    code, err = run(capsys, *argv)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and words in err, err


def test_serve_refuses_a_misspelt_config_file(capsys, tmp_path):
    cfg = tmp_path / "decode.json"
    cfg.write_text(json.dumps({"model": "m", "pagesize": 4}))
    code, err = run(capsys, "serve", "decode", "--config", str(cfg))
    assert code == 2 and "--config" in err and "pagesize" in err


def test_serve_flags_mirror_the_settings(capsys):
    from services.launch import add_service_commands  # noqa: F401  (the parser is built from the settings)
    from services.settings import SETTINGS

    with pytest.raises(SystemExit):
        main(["serve", "decode", "--help"])
    help_text = capsys.readouterr().out
    for name in SETTINGS["decode"].model_fields:
        assert f"--{name.replace('_', '-')}" in help_text, name


@pytest.mark.parametrize("argv, words", [
    (["up", "--prefill-devices", "gpu0", "--decode-devices", "cuda:1"], "device 'gpu0': expected cpu, cuda or cuda:N"),
    (["up", "--prefill-devices", "cpu", "--decode-devices", "cuda:1"], "one kind of device"),
    (["up", "--decode", "2", "--decode-devices", "cuda:1,cuda:2,cuda:3"], "disagree"),
    (["up", "--prefill-devices", ",", "--decode-devices", "cuda:1"], "at least one device each"),
    (["up", "--prefill-devices", "cuda:0", "--decode-devices", "cuda:0,cuda:0", "--gpu-memory-fraction", "0.4"],
     "(> 1)"),
])
def test_up_refuses_a_device_list_it_cannot_run_with_one_line(capsys, argv, words):
    code, err = run(capsys, *argv)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and words in err, err


def test_device_plan_gives_one_instance_per_device_and_splits_a_shared_gpu():
    from services.launch import device_plan

    assert device_plan(["cuda:0"], ["cuda:1", "cuda:2", "cuda:3"]) == {  # 1P3D: a GPU each, the default fraction
        "prefill": {"device": "cuda:0"}, "decode": {"device": "cuda:1"}, "decode-2": {"device": "cuda:2"},
        "decode-3": {"device": "cuda:3"}}
    assert device_plan(["cuda:0"], ["cuda:0"]) == {  # pd1: 0.45 each, as eyrie up always gave one GPU's pair
        "prefill": {"device": "cuda:0", "gpu_memory_fraction": 0.45},
        "decode": {"device": "cuda:0", "gpu_memory_fraction": 0.45}}
    plan = device_plan(["cuda"], ["cuda:0", "cuda:1"])  # "cuda" is cuda:0: shared with the first decode
    assert plan["prefill"]["gpu_memory_fraction"] == plan["decode"]["gpu_memory_fraction"] == 0.45
    assert "gpu_memory_fraction" not in plan["decode-2"]
    three = device_plan(["cuda:0"], ["cuda:0", "cuda:0"])
    assert [f["gpu_memory_fraction"] for f in three.values()] == [0.3, 0.3, 0.3]
    assert device_plan(["cuda:0"], ["cuda:0"], fraction=0.4)["decode"]["gpu_memory_fraction"] == 0.4
    assert device_plan(["cpu", "cpu"], ["cpu"]) == {"prefill": {"device": "cpu"}, "prefill-2": {"device": "cpu"},
                                                   "decode": {"device": "cpu"}}


def test_several_routers_share_the_ports_and_nothing_else():
    from services.launch import Stack

    stack = Stack("m", None, "redis://x", 50123, 8123, replicas={"router": 3, "decode": 2})
    flags = stack.plan()
    assert stack.names == ["prefill", "decode", "decode-2", "router", "router-2", "router-3"]
    routers = [flags[n] for n in ("router", "router-2", "router-3")]
    for f in routers:
        assert f[f.index("--grpc-port") + 1] == "50123" and f[f.index("--openai-port") + 1] == "8123"
        assert f[f.index("--reuse-port") + 1] == "true"
    assert len({f[f.index("--http-port") + 1] for f in flags.values()}) == 6  # each its own /health
    assert "--reuse-port" not in flags["decode"]
    assert "--reuse-port" not in Stack("m", None, "redis://x", 50123, replicas={}).plan()["router"]
