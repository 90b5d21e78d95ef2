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
