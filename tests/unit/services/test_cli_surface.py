"""The command line's surface: every flag's help shows its default, the engine's flags are the settings
model's (one default everywhere), ``--version``, YAML config files, and one line with exit 2 for every bad
input a user can type."""

from __future__ import annotations

import argparse
import json
import socket
from importlib.metadata import version

import pytest

from services.cli import build_parser, main
from services.settings import EngineOptions, flag, load_settings, shown
from shared.config import EngineConfig, SpecConfig


def subparsers(parser: argparse.ArgumentParser, path=()):
    """(command path, parser) for every command and sub-command."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from subparsers(sub, (*path, name))


def option_help(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Option string -> its formatted help line(s), as ``--help`` prints them."""
    formatter = parser._get_formatter()
    out = {}
    for action in parser._actions:
        if action.option_strings and action.help is not argparse.SUPPRESS:
            out[action.option_strings[-1]] = formatter._expand_help(action) if action.help else ""
    return out


def run(capsys, *argv) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def test_every_flag_of_every_command_has_help_and_a_default():
    commands = dict(subparsers(build_parser()))
    assert {("generate",), ("up",), ("serve", "decode"), ("client",), ("train-draft",)} <= set(commands)
    for path, parser in commands.items():
        for option, text in option_help(parser).items():
            if option in ("--help", "--version"):
                continue
            assert text and ("(default: " in text or "(required)" in text), (path, option, text)


def test_help_output_shows_the_defaults(capsys):
    code, out, _ = run(capsys, "serve", "decode", "--help")
    assert code == 0
    assert "--chunk-size" in out and f"(default: {EngineConfig().chunk_size}; env EYRIE_CHUNK_SIZE)" in " ".join(
        out.split())


@pytest.mark.parametrize("command", [("generate",), ("up",), ("serve", "prefill"), ("serve", "decode")])
def test_engine_flags_come_from_the_settings_model_with_one_default(command):
    """generate, up and serve take every engine setting, each showing the engine's own default (the chunk size
    was 512 in one command and 64 in another)."""
    parser = dict(subparsers(build_parser()))[command]
    helps = option_help(parser)
    for name, field in EngineOptions.model_fields.items():
        assert flag(name) in helps, (command, name)
        if name not in ("model", "draft"):
            assert f"(default: {shown(field.default)};" in helps[flag(name)], (command, name, helps[flag(name)])
    assert EngineOptions.model_fields["chunk_size"].default == EngineConfig().chunk_size
    assert EngineOptions.model_fields["spec_steps"].default == SpecConfig().steps


def test_version(capsys):
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.startswith(f"eyrie {version('eyrie-serve')} (torch ")


def test_yaml_config_is_honoured_below_env_and_flags(tmp_path, monkeypatch):
    cfg = tmp_path / "eyrie.yaml"
    cfg.write_text("page-size: 4\nchunk_size: 96\nEYRIE_SPEC_TOPK: 2\nmax_running: 3\nlog_level: warning\n"
                   "openai_port: 8001\n")
    monkeypatch.setenv("EYRIE_CHUNK_SIZE", "128")
    s = load_settings("decode", str(cfg), max_running="5")
    assert (s.page_size, s.chunk_size, s.spec_topk, s.max_running, s.log_level) == (4, 128, 2, 5, "WARNING")
    assert load_settings("router", str(cfg)).openai_port == 8001  # one file for every role
    assert load_settings(EngineOptions, str(cfg)).page_size == 4  # and for eyrie generate
    (tmp_path / "empty.yml").write_text("")
    assert load_settings("decode", str(tmp_path / "empty.yml")).page_size == EngineConfig().page_size


def busy_port() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s


@pytest.fixture
def model(tiny_model_dir) -> str:
    return str(tiny_model_dir / "target")


def bad_inputs(model: str, draft: str, tmp) -> dict[str, tuple[list[str], list[str]]]:
    """name -> (argv, words the one stderr line must hold)."""
    (tmp / "typo.yaml").write_text("model: m\npage_sise: 4\n")
    (tmp / "broken.yaml").write_text("page_size: [4\n")
    (tmp / "list.yaml").write_text("- 1\n- 2\n")
    return {
        "log_level": (["serve", "router", "--model", model, "--log-level", "loud"],
                      ["log_level", "'INFO'", "--log-level", "loud"]),
        "serve_config_typo": (["serve", "decode", "--model", model, "--config", str(tmp / "typo.yaml")],
                               ["--config", "page_sise"]),
        "yaml_broken": (["serve", "decode", "--config", str(tmp / "broken.yaml")], ["--config", "YAML"]),
        "yaml_not_a_mapping": (["serve", "decode", "--config", str(tmp / "list.yaml")], ["--config", "mapping"]),
        "config_missing": (["serve", "router", "--config", str(tmp / "nope.yaml")], ["--config", "nope.yaml"]),
        "serve_draft_missing": (["serve", "decode", "--model", model, "--draft", str(tmp / "nodraft")],
                                ["draft", "nodraft", "not a checkpoint"]),
        "serve_bad_bool": (["serve", "decode", "--model", model, "--cuda-graph", "perhaps"],
                           ["cuda_graph", "--cuda-graph", "perhaps"]),
        "serve_bad_tree": (["serve", "decode", "--model", model, "--draft", draft, "--spec-draft-tokens", "9"],
                           ["num_draft_tokens"]),
        "up_log_level": (["up", "--model", model, "--log-level", "chatty"], ["log_level", "chatty"]),
        "up_page_size": (["up", "--model", model, "--page-size", "four"], ["page_size", "four"]),
        "up_draft_missing": (["up", "--model", model, "--draft", str(tmp / "nodraft")], ["--draft", "nodraft"]),
        "up_config_typo": (["up", "--config", str(tmp / "typo.yaml")], ["--config", "page_sise"]),
        "generate_config_typo": (["generate", "--prompt", "hi", "--config", str(tmp / "typo.yaml")],
                                 ["--config", "page_sise"]),
        "generate_draft_is_a_target": (["generate", "--model", model, "--draft", model, "--prompt", "hi"],
                                       ["draft head"]),
        "generate_mtp_too_shallow": (["generate", "--model", model, "--draft", draft.replace("eagle", "mtp"),
                                      "--spec-steps", "9", "--prompt", "hi"], ["spec steps", "9"]),
    }


CASES = ["log_level", "serve_config_typo", "yaml_broken", "yaml_not_a_mapping", "config_missing",
         "serve_draft_missing", "serve_bad_bool", "serve_bad_tree", "up_log_level", "up_page_size", "up_draft_missing",
         "up_config_typo", "generate_config_typo", "generate_draft_is_a_target", "generate_mtp_too_shallow"]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_exits_2_with_one_line(capsys, tmp_path, tiny_model_dir, model, case):
    argv, words = bad_inputs(model, str(tiny_model_dir / "eagle"), tmp_path)[case]
    code, out, err = run(capsys, *argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("eyrie: error: "), err
    assert all(w in lines[0] for w in words), (words, lines[0])
    assert "Traceback" not in err


@pytest.mark.parametrize("which", ["--grpc-port", "--http-port", "--openai-port"])
def test_a_busy_port_exits_2_with_the_hint_to_use_port_0(capsys, model, which):
    with busy_port() as s:
        port = s.getsockname()[1]
        code, _, err = run(capsys, "serve", "router", "--model", model, which, str(port))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert str(port) in lines[0] and "in use" in lines[0] and f"{which} 0" in lines[0], lines[0]


def test_up_refuses_a_busy_router_port_before_starting_anything(capsys, model):
    with busy_port() as s:
        port = s.getsockname()[1]
        code, out, err = run(capsys, "up", "--model", model, "--grpc-port", str(port))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert f"port {port}" in err and "in use" in err and "--grpc-port 0" in err


def test_settings_json_file_still_reads(tmp_path):
    cfg = tmp_path / "eyrie.json"
    cfg.write_text(json.dumps({"page_size": 2}))
    assert load_settings("prefill", str(cfg)).page_size == 2
