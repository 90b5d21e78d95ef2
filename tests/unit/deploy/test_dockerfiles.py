"""The Dockerfiles: hadolint over each, then the rules this project holds them to (pinned bases, multi-stage,
non-root, health check, what the build context lets in), and the shared entrypoint run here.

The images themselves are not built in CI (no Docker engine); everything a build would check without
one is checked here.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.unit.deploy.conftest import DOCKERFILES, ROOT, compose_config, require_tool

ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"


@dataclass
class Stage:
    image: str  # with ARG defaults substituted
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, arguments)

    def all(self, op: str) -> list[str]:
        return [args for ins, args in self.instructions if ins == op]


def parse(path: Path) -> tuple[dict[str, str], list[Stage]]:
    """Global ARG defaults and the stages of a Dockerfile (continuation lines joined, comments dropped)."""
    lines, buf = [], ""
    for raw in path.read_text().splitlines():
        if not buf and raw.lstrip().startswith("#"):
            continue
        if raw.rstrip().endswith("\\"):
            buf += raw.rstrip()[:-1] + " "
            continue
        line = (buf + raw).strip()
        buf = ""
        if line and not line.startswith("#"):
            lines.append(line)
    args, stages = {}, []
    for line in lines:
        op, _, rest = line.partition(" ")
        op, rest = op.upper(), rest.strip()
        if op == "ARG" and not stages:
            name, _, default = rest.partition("=")
            args[name] = default
        elif op == "FROM":
            parts = rest.split()
            image = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), ""), parts[0])
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            stages.append(Stage(image, name))
        else:
            stages[-1].instructions.append((op, rest))
    return args, stages


def ci_torch_pin() -> str:
    m = re.search(r"pip install[^\n]*torch==([\w.+]+)", (ROOT / ".ci" / "run").read_text())
    assert m, ".ci/run pins no torch version"
    return m.group(1)


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_is_clean(path):
    proc = subprocess.run([require_tool("hadolint"), "--no-color", str(path)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr


def test_hadolint_flags_a_bad_dockerfile(tmp_path):
    """Negative control: the linter runs its rules (latest tag, unpinned and uncleaned apt, root user)."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get update && apt-get install -y curl\nUSER root\n")
    proc = subprocess.run([require_tool("hadolint"), "--no-color", str(bad)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0
    for rule in ("DL3007", "DL3008", "DL3009", "DL3002"):
        assert rule in proc.stdout, (rule, proc.stdout)


def test_both_images_exist_and_compose_builds_them():
    assert {p.name for p in DOCKERFILES} == {"Dockerfile.cpu", "Dockerfile.cuda"}
    services = compose_config()["services"]
    built = {svc["build"]["dockerfile"] for svc in services.values() if "build" in svc}
    assert built == {"docker/Dockerfile.cpu", "docker/Dockerfile.cuda"}
    for svc in services.values():
        if "build" in svc:
            assert (Path(svc["build"]["context"]) / svc["build"]["dockerfile"]).exists()
            assert re.fullmatch(r"[\w./-]+:\d+\.\d+\.\d+", svc["image"]), svc["image"]  # a versioned tag


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_bases_are_pinned_and_the_build_is_multi_stage(path):
    args, stages = parse(path)
    assert len(stages) >= 2, "one stage builds, a clean one runs"
    names = {s.name for s in stages if s.name}
    for stage in stages:
        if stage.image in names:  # FROM an earlier stage
            continue
        repo, _, tag = stage.image.partition(":")
        assert tag and tag != "latest" and re.search(r"\d+\.\d+", tag), f"{stage.image} is not pinned"
    final = stages[-1]
    copied_from = {m.group(1) for args_ in final.all("COPY") for m in [re.search(r"--from=(\S+)", args_)] if m}
    assert copied_from and copied_from <= names, "the runtime stage copies the build stage's output"


def test_cuda_image_base_and_cpu_image_torch():
    _, cuda = parse(ROOT / "docker" / "Dockerfile.cuda")
    assert re.fullmatch(r"pytorch/pytorch:\d+\.\d+\.\d+-cuda12\.\d+-cudnn9-runtime", cuda[-1].image), cuda[-1].image
    # Triton compiles its launcher with a C compiler the runtime base lacks.
    assert any("gcc" in run for run in cuda[-1].all("RUN"))
    args, cpu = parse(ROOT / "docker" / "Dockerfile.cpu")
    assert re.fullmatch(r"python:3\.11\.\d+-slim(-\w+)?", cpu[-1].image), cpu[-1].image
    torch_run = next(r for r in cpu[0].all("RUN") if "torch==" in r)
    assert "--index-url https://download.pytorch.org/whl/cpu" in torch_run
    version = next(a.partition("=")[2] for a in cpu[0].all("ARG") if a.startswith("TORCH_VERSION="))
    assert version == ci_torch_pin(), "the CPU image should run the torch that CI tests"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_runtime_stage_is_non_root_with_healthcheck_and_entrypoint(path):
    _, stages = parse(path)
    final = stages[-1]
    users = final.all("USER")
    assert users, "the runtime stage sets a USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"USER {users[-1]} must be a numeric non-root uid"
    assert any(f"--uid {uid}" in run for run in final.all("RUN")), "the uid is created in the image"
    # The last USER comes after every RUN that needs root.
    ops = [op for op, _ in final.instructions]
    assert max(i for i, op in enumerate(ops) if op == "RUN") < max(i for i, op in enumerate(ops) if op == "USER")
    health = final.all("HEALTHCHECK")
    assert len(health) == 1 and "/health" in health[0] and "EYRIE_HTTP_PORT" in health[0]
    cmd = json.loads(health[0][health[0].index("CMD") + 3:].strip())
    assert cmd[0] == "python"  # no curl in slim images
    assert json.loads(final.all("ENTRYPOINT")[0]) == ["/usr/local/bin/eyrie-entrypoint"]
    assert json.loads(final.all("CMD")[0])[:2] == ["eyrie", "serve"]
    env = " ".join(final.all("ENV"))
    assert "EYRIE_HOST=0.0.0.0" in env and "EYRIE_HTTP_PORT=8080" in env


# ---- the build context ---------------------------------------------------------------------------
def _pattern_regex(pattern: str) -> re.Pattern:
    """A .dockerignore pattern as a regex: `*` and `?` within one path element, `**` across elements."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def dockerignore_allows(path: str) -> bool:
    """Docker's reading of .dockerignore: the last pattern matching the path, or one of its parent folders,
    decides; `!` re-includes."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    allowed = True
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        regex = _pattern_regex(line.lstrip("!").strip("/"))
        if any(regex.fullmatch(p) for p in prefixes):
            allowed = negate
    return allowed


def test_build_context_has_the_sources_and_nothing_else():
    for path in ("pyproject.toml", "README.md", "shared/engine.py", "services/router/openai_http.py",
                 "proto/eyrie/v1/eyrie_pb2.py", "kernels/attention.py", "docker/entrypoint.sh"):
        assert dockerignore_allows(path), path
    for path in (".git/config", "tests/conftest.py", ".whl/x.whl", "models/target/model.safetensors",
                 "shared/__pycache__/engine.cpython-311.pyc", "docs/deploy.md", "docker-compose.yml",
                 "eyrie_serve.egg-info/PKG-INFO", "dump.rdb", ".env", "bench/bench_decode.py"):
        assert not dockerignore_allows(path), path
    # Every COPY source (outside --from) is in the repository and in the context.
    for dockerfile in DOCKERFILES:
        for stage in parse(dockerfile)[1]:
            for args in stage.all("COPY"):
                if "--from=" in args:
                    continue
                sources = [a for a in shlex.split(args) if not a.startswith("--")][:-1]
                for src in sources:
                    assert (ROOT / src).exists(), (dockerfile.name, src)
                    assert dockerignore_allows(src), (dockerfile.name, src)


# ---- the entrypoint ------------------------------------------------------------------------------
def run_entrypoint(env: dict) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("EYRIE_")}
    proc = subprocess.run(["sh", str(ENTRYPOINT), "env"], env={**base, **env}, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0, proc.stderr
    return dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)


def test_entrypoint_drops_empty_settings_and_advertises_the_container():
    out = run_entrypoint({"EYRIE_DRAFT": "", "EYRIE_NUM_PAGES": "", "EYRIE_MODEL": "/models/target",
                          "OTHER_EMPTY": ""})
    assert "EYRIE_DRAFT" not in out and "EYRIE_NUM_PAGES" not in out  # empty = the setting's default
    assert out["EYRIE_MODEL"] == "/models/target" and out["OTHER_EMPTY"] == ""
    advertised = out["EYRIE_ADVERTISE_HOST"]
    assert advertised and not advertised.startswith("127.")
    assert advertised == socket_address_or_hostname()
    assert run_entrypoint({"EYRIE_ADVERTISE_HOST": "decode-7"})["EYRIE_ADVERTISE_HOST"] == "decode-7"
    # It execs the command: the exit status is the command's.
    assert subprocess.run(["sh", str(ENTRYPOINT), "sh", "-c", "exit 7"], timeout=30).returncode == 7


def socket_address_or_hostname() -> str:
    """What a container's entrypoint advertises: its hostname's address (what /etc/hosts maps it to in a
    container), or the hostname where that is a loopback address (like on this machine)."""
    import socket

    try:
        addr = socket.gethostbyname(socket.gethostname())
    except OSError:
        addr = ""
    return addr if addr and not addr.startswith("127.") else subprocess.run(
        ["hostname"], capture_output=True, text=True).stdout.strip()
