"""The one declaration of every setting: each field's type, default and meaning, once.

Everything else is derived from these models: the flags of ``eyrie serve``, ``eyrie generate`` and
``eyrie up`` (``add_flags``), the ``EYRIE_*`` environment variables (pydantic-settings), the ``--config``
files (YAML, JSON or KEY=VALUE) and the settings table of README.md and docs/deploy.md
(docker/config_table.py). The engine's settings are declared once, in ``EngineConfig`` (``shared/config.py``: type,
default, meaning), and ``EngineOptions`` takes them from there (``FROM_ENGINE``); the tree's defaults are
``SpecConfig``'s, but for the tree a draft gets when no tree setting is given (``ADAPTIVE_TREE``).

Precedence (highest first): command-line flags, environment, the ``--config`` file, defaults.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, ValidationError, create_model, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.config import EngineConfig, SpecConfig

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# The tree a draft gets when no tree setting is given: the adaptive policy's default shapes (``default_candidates``:
# itself for batches of 1-4, a tree of 8 tokens, chains of 3 to 1) all fit within it.
ADAPTIVE_TREE = SpecConfig(topk=4, steps=4, num_draft_tokens=16)


def _spec(name: str):
    return SpecConfig.model_fields[name].default


class CommonSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EYRIE_", extra="ignore")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis for the instance registry and request "
                           "records (`redis://:PASSWORD@HOST:PORT/DB`)")
    host: str = Field("127.0.0.1", description="address to bind (gRPC, `/health` + `/metrics`, OpenAI HTTP)")
    advertise_host: str | None = Field(None, description="address other services dial, recorded in the registry "
                                       "(default: `host`; the images default it to the container's IP)")
    grpc_port: int = Field(0, description="gRPC port (0 = any free port)")
    http_port: int = Field(0, description="`/health` and `/metrics` port (0 = any free port)")
    instance_id: str | None = Field(None, description="name in the registry and in logs (default: role + random "
                                    "suffix)")
    heartbeat_s: float = Field(1.0, description="seconds between registry heartbeats")
    registry_ttl_s: float = Field(5.0, description="seconds a registry entry lives without a heartbeat")
    log_level: Literal[LOG_LEVELS] = Field("INFO", description="DEBUG, INFO, WARNING or ERROR")
    api_key: str | None = Field(None, description="when set, every gRPC call (the router's API, the internal "
                                "prefill and decode services, server reflection) and every HTTP request (`/metrics`, "
                                "the OpenAI API) needs `authorization: Bearer <key>`; `/health` and `grpc.health.v1` "
                                "stay open. Give every service of a stack the same key: they call each other with it")
    model_name: str = Field("eyrie", description="the model's name in the OpenAI API (`model`) and in GetModelInfo")
    drain_timeout_s: float = Field(30.0, description="on SIGTERM: `/health` answers 503, no new request is taken, "
                                   "and requests in flight have this many seconds to finish before the service "
                                   "exits (status 0)")

    @field_validator("log_level", mode="before")
    @classmethod
    def _level(cls, v):
        return v.upper() if isinstance(v, str) else v

    @property
    def advertised(self) -> str:
        return self.advertise_host or self.host


class _EngineOwn(BaseSettings):
    """The settings an engine service takes besides ``EngineConfig``'s (paths, the tree shape's parts, the shapes
    as text, the transport); ``EngineOptions`` adds ``EngineConfig``'s own, declared there."""

    model_config = SettingsConfigDict(env_prefix="EYRIE_", extra="ignore")
    model: str | None = Field(None, description="target checkpoint directory (the router reads only `config.json` "
                              "and the tokenizer)")
    draft: str | None = Field(None, description="draft head directory (EAGLE, EAGLE-3 or multi-layer); unset = no "
                              "speculation")
    spec_topk: int = Field(_spec("topk"), description="draft tree: top-k per step (1 = chain); with no tree "
                           f"setting given at all, {ADAPTIVE_TREE.topk} (the tree `{ADAPTIVE_TREE.name}`, which the "
                           "adaptive policy's default shapes fit within)")
    spec_steps: int = Field(_spec("steps"), description="draft tree: depth; with no tree setting given at all, "
                            f"{ADAPTIVE_TREE.steps}")
    spec_draft_tokens: int | None = Field(None, description="draft tree: nodes verified per step (default: steps + 1 "
                                          "for a chain, 8 for a tree; with no tree setting given at all, "
                                          f"{ADAPTIVE_TREE.num_draft_tokens})")
    spec_candidates: str | None = Field(None, description="with `adaptive`: the tree shapes it chooses among "
                                        "besides the configured one, comma-separated (`chain3`, `tree-k4-s3-n8`: "
                                        "each within the configured tree); unset = a tree of half the configured "
                                        "verified tokens (where wider than a chain) and chains of depth "
                                        "min(steps, 3) down to 1")
    handoff_transport: str = Field("auto", description="the hand-off's data transport: `auto` (ipc on one host when "
                                   "the decode pools are reachable, else the gRPC stream), `ipc`, `grpc-stream` or "
                                   "`nixl` (on a decode instance, `grpc-stream` stops it exporting its pools, `nixl` "
                                   "offers NIXL and the stream: both services must name it; UCX_TLS picks UCX's "
                                   "transports)")

    def tree(self) -> SpecConfig:
        """The configured tree: with no tree setting given (flag, environment or file) ``ADAPTIVE_TREE``, whatever
        the policy (a prefill and a decode instance agree on it whichever policy each is given: the decode
        instance's alone chooses); else the settings, their defaults for the others."""
        if not {"spec_topk", "spec_steps", "spec_draft_tokens"} & self.model_fields_set:
            return ADAPTIVE_TREE
        n = self.spec_draft_tokens or (self.spec_steps + 1 if self.spec_topk == 1 else 8)
        return SpecConfig(topk=self.spec_topk, steps=self.spec_steps, num_draft_tokens=n)

    @field_validator("handoff_transport")
    @classmethod
    def _transport(cls, v: str) -> str:
        if v not in ("auto", "ipc", "grpc-stream", "nixl"):
            raise ValueError(f"handoff_transport must be auto, ipc, grpc-stream or nixl, got {v!r}")
        return v

    @field_validator("draft", mode="before")
    @classmethod
    def _no_draft(cls, v):  # "--draft none" switches speculation off
        return None if isinstance(v, str) and v.strip().lower() in ("", "none") else v

    @field_validator("spec_draft_ahead", mode="before", check_fields=False)  # a field EngineOptions adds
    @classmethod
    def _auto(cls, v):
        return None if isinstance(v, str) and v.strip().lower() == "auto" else v

    def engine_config(self) -> EngineConfig:
        """The engine's configuration: every setting ``EngineConfig`` declares under the same name, and the
        tree shape (``spec_*``) with a draft."""
        spec = None
        if self.draft:
            spec = self.tree()
        return EngineConfig(spec=spec, **{name: getattr(self, name) for name in ENGINE_SETTINGS})


# ``EngineConfig``'s settings a service takes, declared there once (type, default, meaning) and added here as they
# are: everything but the tree's parts (``spec``: the service's ``spec_*``), the graph phases (tests and benchmarks),
# the pools' sharing (a decode engine's own) and the shapes (text here).
FROM_ENGINE = ("device", "dtype", "page_size", "num_pages", "max_running", "max_context", "chunk_size", "cuda_graph",
               "cuda_graph_mixed", "cuda_graph_max_bs", "spec_draft_ahead", "spec_policy", "spec_draft_backlog",
               "tensor_parallel", "prefix_cache", "gpu_memory_fraction", "batch_invariant")
EngineOptions = create_model(
    "EngineOptions", __base__=_EngineOwn, __module__=__name__,
    **{n: (EngineConfig.model_fields[n].annotation, Field(EngineConfig.model_fields[n].default,
                                                          description=EngineConfig.model_fields[n].description))
       for n in FROM_ENGINE})
EngineOptions.__doc__ = "The engine's settings: what ``eyrie generate`` takes, and the engine services besides theirs."

# The engine settings a service passes as they are: the fields ``EngineOptions`` shares with ``EngineConfig``.
ENGINE_SETTINGS = tuple(name for name in EngineOptions.model_fields if name in EngineConfig.model_fields)


class EngineSettings(EngineOptions, CommonSettings):
    """An engine service's settings: the common ones, then the engine's."""

    prefix_summary_pages: int = Field(4096, ge=0, description="with `prefix_cache`: the cached pages (most "
                                      "recently used first) whose digests the instance publishes with its "
                                      "heartbeat, for the router's prefix-aware placement (8 bytes each; 0 = "
                                      "none published)")


class PrefillSettings(EngineSettings):
    handoff_chunk_bytes: int = Field(4 << 20, description="largest KV chunk of the prefill -> decode hand-off")
    handoff_streams: int = Field(2, ge=1, description="parallel gRPC streams (each on a connection of its own) a "
                                 "grpc-stream hand-off is split over, by ranges of its layers (more than 1 pays "
                                 "where cores are free: docs/benchmarks.md)")
    handoff_timeout_s: float = Field(60.0, description="seconds a hand-off may take")
    handoff_workers: int = Field(32, description="hand-offs under way at once (each holds one request from its "
                                                 "first chunk to its acknowledgement)")


class DecodeSettings(EngineSettings):
    stream_attach_timeout_s: float = Field(30.0, description="a handed-off request nobody streams is aborted after "
                                           "this")
    stream_idle_timeout_s: float = Field(300.0, description="a request that produces no token for this long is "
                                         "aborted")


class RouterSettings(CommonSettings):
    model: str | None = Field(None, description=EngineOptions.model_fields["model"].description)
    max_context: int | None = Field(None, description="longest prompt + output in tokens (default: the model's)")
    default_max_new_tokens: int = Field(256, description="output length when a request gives none")
    request_ttl_s: float = Field(3600, description="seconds a finished, failed or aborted request's record stays in "
                                 "Redis")
    max_message_bytes: int = Field(4 << 20, description="largest request (gRPC message or HTTP body)")
    openai_port: int | None = Field(None, description="OpenAI-compatible HTTP port (unset = off; 0 = any free port)")
    http_read_timeout_s: float = Field(10.0, description="an HTTP request's head, then its body, must arrive within "
                                       "this many seconds (else the connection closes, or 408)")
    placement_timeout_s: float = Field(10.0, description="seconds to wait for a prefill and a decode instance that "
                                       "can take a request")
    stream_timeout_s: float = Field(300.0, description="deadline of one request's prefill and decode calls")
    max_concurrent_requests: int = Field(1024, description="requests in flight at most: past it a new request gets "
                                         "RESOURCE_EXHAUSTED / 429 (0 = no cap)")
    local_prefill_max_tokens: int = Field(0, ge=0, description="conditional disaggregation: a new request with at "
                                          "most this many prompt tokens to compute on its decode instance (past the "
                                          "prefix that instance's published prefix cache holds) is prefilled there "
                                          "(folded into its decode steps, no hand-off); the others go to a prefill "
                                          "instance. 0 = every prompt goes to a prefill instance")
    reuse_port: bool = Field(False, description="several router processes on one host serve the same gRPC and OpenAI "
                             "ports (SO_REUSEPORT: the kernel spreads the connections over them); each router is "
                             "stateless for placement (`eyrie up --routers N` sets it)")
    gil_switch_interval_ms: float = Field(0.5, gt=0, description="the router process's Python thread switch interval "
                                          "(`sys.setswitchinterval`): its I/O pool threads' Redis batches hand the "
                                          "GIL back to the event loop within this (Python's default 5 ms added "
                                          "~5-8 ms to every relayed token at 256-512 streams: docs/benchmarks.md)")
    decode_relay: bool = Field(True, description="stream tokens from each decode instance over one relay per "
                               "router (a step's tokens for all of this router's requests in one message) rather "
                               "than a stream per request")
    max_queued: int = Field(1024, ge=0, description="back-pressure: requests that may wait in this router for room "
                            "while every decode instance is full; past it a new request gets RESOURCE_EXHAUSTED / "
                            "503 with Retry-After before any token")
    queue_timeout_s: float = Field(30.0, gt=0, description="seconds a request waits for room on a decode instance "
                                   "before it is refused (RESOURCE_EXHAUSTED / 503 with Retry-After)")
    max_stop_strings: int = Field(64, ge=0, description="stop strings a request may give at most (more: 400 / "
                                  "INVALID_ARGUMENT naming the limit)")
    max_stop_length: int = Field(1024, ge=1, description="characters a stop string may have at most (longer: 400 / "
                                 "INVALID_ARGUMENT naming the limit)")
    max_n: int = Field(16, ge=1, description="choices a request may ask for at most (OpenAI's n and best_of; more: "
                       "400 / INVALID_ARGUMENT naming the parameter and the limit)")
    prefix_routing: bool = Field(True, description="place a prompt on the instance whose published prefix cache "
                                 "summary holds most of its leading pages (instances with `prefix_cache`: the "
                                 "prefill instance, and the decode instance, whose hand-off then carries only the "
                                 "pages it lacks), within "
                                 "`prefix_balance_tokens`; off (or no summary published): the least loaded one")
    prefix_balance_tokens: int = Field(4096, ge=0, description="prefix-aware placement's bound on imbalance: an "
                                       "instance is chosen for the prompt tokens it holds only while its load "
                                       "(outstanding tokens) is within this many tokens of the least loaded one's; "
                                       "among those the one with the least load less its matched tokens wins")
    max_header_bytes: int = Field(16384, ge=1024, description="an OpenAI HTTP request's header lines together may "
                                  "have at most this many bytes (more: 400 naming the limit)")


SETTINGS = {"router": RouterSettings, "prefill": PrefillSettings, "decode": DecodeSettings}
KNOWN = frozenset(name for c in (*SETTINGS.values(), EngineOptions) for name in c.model_fields)


def load_settings(kind: str | type[BaseSettings], config_file: str | None = None, **flags) -> BaseSettings:
    """Settings for service ``kind`` (or of the settings class ``kind``): flags over environment over file over
    defaults. A bad value raises ``ValidationError`` (the engine's settings are checked whole, as the engine will
    take them); an unreadable, malformed or misspelt file ``SettingsFileError``."""
    cls = SETTINGS[kind] if isinstance(kind, str) else kind
    file_values = read_config_file(config_file) if config_file else {}
    file_values = {k: v for k, v in file_values.items() if k in cls.model_fields}
    env = cls()  # reads EYRIE_* (only the fields the environment set count, even when equal to a default)
    env_values = env.model_dump(include=env.model_fields_set)
    settings = cls(**{**file_values, **env_values, **{k: v for k, v in flags.items() if v is not None}})
    if isinstance(settings, EngineOptions):
        settings.engine_config()
    return settings


class SettingsFileError(ValueError):
    """A ``--config`` file that cannot be read, is malformed, or names a setting no service knows."""


def read_config_file(path: str) -> dict:
    """A YAML (``.yaml``/``.yml``), JSON (``.json``) or KEY=VALUE env file of settings, one file for every role:
    a name no role knows is a typo, refused naming it (``page-size`` and ``EYRIE_PAGE_SIZE`` mean ``page_size``)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise SettingsFileError(f"{path}: {e.strerror or e}") from None
    try:
        if path.endswith((".yaml", ".yml")):
            values = yaml.safe_load(text)
            values = {} if values is None else values
        elif path.endswith(".json"):
            values = json.loads(text)
        else:
            values = _parse_env_file(text)
    except (yaml.YAMLError, json.JSONDecodeError) as e:
        raise SettingsFileError(f"{path}: not valid {'JSON' if path.endswith('.json') else 'YAML'}: "
                                f"{str(e).splitlines()[0]}") from None
    if not isinstance(values, dict):
        kind = "JSON object" if path.endswith(".json") else "mapping"
        raise SettingsFileError(f"{path}: expected a {kind} of settings")
    values = {str(k).lower().removeprefix("eyrie_").replace("-", "_"): v for k, v in values.items()}
    unknown = sorted(set(values) - KNOWN)
    if unknown:
        raise SettingsFileError(f"{path}: unknown setting(s) {', '.join(unknown)}")
    return values


def _parse_env_file(text: str) -> dict:
    values = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            value = value.strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            values[key.strip()] = value
    return values


# ---- command-line flags ---------------------------------------------------------------------------
def flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def shown(value) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def add_flags(parser: argparse.ArgumentParser, cls: type[BaseSettings], names=None, defaults: dict | None = None,
              about: dict | None = None) -> list[str]:
    """One flag per field of ``cls`` (or of ``names``), its help the field's description, default and variable.
    The value stays text for the settings model to validate (argparse's default is None: a flag not given sets
    nothing, so the environment and the file still count). ``defaults`` / ``about`` override what the help
    shows where a command differs. Returns the field names."""
    names = list(names or cls.model_fields)
    for name in names:
        field = cls.model_fields[name]
        default = (defaults or {}).get(name, shown(field.default))
        text = (about or {}).get(name, field.description or name.replace("_", " "))
        help_text = f"{text} (default: {default}; env EYRIE_{name.upper()})"
        parser.add_argument(flag(name), dest=name, default=None, metavar=_metavar(field),
                            help=help_text.replace("%", "%%"))
    return names


def given_flags(args: argparse.Namespace, names) -> dict:
    """The settings flags the command line gave (name -> text)."""
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def describe_error(e: ValidationError, flags: dict | None = None) -> str:
    """One line naming the setting, what is wrong, and the value given (and its flag when a flag gave it)."""
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err["loc"]) or "config"
    message = err["msg"].removeprefix("Value error, ")
    name = str(err["loc"][0]) if err["loc"] else None
    if name is not None and name in (flags or {}):
        return f"{loc}: {message} ({flag(name)} {flags[name]!r})"
    if name is not None and not isinstance(err.get("input"), dict):
        return f"{loc}: {message} (got {err.get('input')!r})"
    return f"{loc}: {message}"


def _metavar(field) -> str:
    text = str(field.annotation).lower()
    for word, meta in (("bool", "BOOL"), ("float", "NUMBER"), ("int", "N")):
        if word in text:
            return meta
    return "TEXT"


__all__ = ["CommonSettings", "DecodeSettings", "EngineOptions", "EngineSettings", "PrefillSettings", "RouterSettings",
           "SettingsFileError", "add_flags", "describe_error", "given_flags", "load_settings", "read_config_file"]
