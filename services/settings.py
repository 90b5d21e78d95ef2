"""Service configuration: flags, ``EYRIE_*`` environment variables, or a JSON/env file.

Precedence (highest first): command-line flags, environment, the ``--config`` file, defaults.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.config import EngineConfig, SpecConfig


class CommonSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EYRIE_", extra="ignore")
    redis_url: str = "redis://127.0.0.1:6379/0"
    host: str = "127.0.0.1"
    advertise_host: str | None = None  # the address other services dial (default: host)
    grpc_port: int = 0  # 0 = pick a free port
    http_port: int = 0  # /health and /metrics
    instance_id: str | None = None
    heartbeat_s: float = 1.0
    registry_ttl_s: float = 5.0
    log_level: str = "INFO"
    api_key: str | None = None  # every service of a stack shares it: they call each other with it
    model_name: str = "eyrie"  # the served model's name: the OpenAI API's `model`, the metrics' model_name label

    @property
    def advertised(self) -> str:
        return self.advertise_host or self.host


class EngineSettings(CommonSettings):
    model: str | None = None  # target checkpoint directory
    draft: str | None = None  # draft head directory; none = no speculation
    device: str = "cpu"
    dtype: str = "float32"
    page_size: int = 16
    num_pages: int | None = None
    max_running: int = 32
    max_context: int | None = None
    chunk_size: int | None = 512
    spec_topk: int = 1
    spec_steps: int = 3
    spec_draft_tokens: int | None = None
    cuda_graph: bool = False
    spec_draft_ahead: bool | None = None
    # The hand-off's data transport: auto (ipc on the same host when the pools are reachable, else the gRPC
    # stream), or forced: ipc | grpc-stream. On a decode instance, grpc-stream stops it exporting its pools.
    handoff_transport: str = "auto"

    @field_validator("handoff_transport")
    @classmethod
    def _transport(cls, v: str) -> str:
        if v not in ("auto", "ipc", "grpc-stream"):
            raise ValueError(f"handoff_transport must be auto, ipc or grpc-stream, got {v!r}")
        return v

    @field_validator("draft", mode="before")
    @classmethod
    def _no_draft(cls, v):  # "--draft none" switches speculation off
        return None if isinstance(v, str) and v.strip().lower() in ("", "none") else v

    def engine_config(self) -> EngineConfig:
        spec = None
        if self.draft:
            n = self.spec_draft_tokens or (self.spec_steps + 1 if self.spec_topk == 1 else 8)
            spec = SpecConfig(topk=self.spec_topk, steps=self.spec_steps, num_draft_tokens=n)
        return EngineConfig(device=self.device, dtype=self.dtype, page_size=self.page_size, num_pages=self.num_pages,
                            max_running=self.max_running, max_context=self.max_context, chunk_size=self.chunk_size,
                            spec=spec, cuda_graph=self.cuda_graph, spec_draft_ahead=self.spec_draft_ahead)


class PrefillSettings(EngineSettings):
    handoff_chunk_bytes: int = 4 << 20  # K + V bytes per hand-off message (page-aligned; >= one page of one layer)
    handoff_timeout_s: float = 60.0
    handoff_workers: int = 8  # hand-offs under way at once (each streams one request's pages)


class DecodeSettings(EngineSettings):
    stream_attach_timeout_s: float = 30.0  # a handed-off request nobody streams is aborted after this
    stream_idle_timeout_s: float = 300.0


class RouterSettings(CommonSettings):
    model: str | None = None  # model directory: the router reads config.json and tokenizer.json, no weights
    max_context: int | None = None
    default_max_new_tokens: int = 256
    request_ttl_s: float = 3600  # finished / failed / aborted records expire after this
    max_message_bytes: int = 4 << 20
    openai_port: int | None = None  # OpenAI-compatible HTTP; None = off
    http_read_timeout_s: float = 10.0  # an HTTP request's head, and then its body, must arrive within this
    placement_timeout_s: float = 10.0
    stream_timeout_s: float = 300.0  # deadline of the prefill + hand-off call (the decode stream has none)
    max_concurrent_requests: int = 1024  # past it a new request gets RESOURCE_EXHAUSTED / 429; 0 = no cap


SETTINGS = {"router": RouterSettings, "prefill": PrefillSettings, "decode": DecodeSettings}


def load_settings(kind: str, config_file: str | None = None, **flags) -> CommonSettings:
    """Build settings for service ``kind``: flags over environment over file over defaults."""
    cls = SETTINGS[kind]
    file_values = {}
    if config_file:
        text = Path(config_file).read_text()
        file_values = json.loads(text) if config_file.endswith(".json") else _parse_env_file(text)
        if not isinstance(file_values, dict):
            raise ValueError(f"{config_file}: expected a JSON object of settings")
        # One file may configure every role; a name no role knows is a typo, refused rather than ignored.
        unknown = sorted(set(file_values) - {name for c in SETTINGS.values() for name in c.model_fields})
        if unknown:
            raise ValueError(f"{config_file}: unknown setting(s) {', '.join(unknown)}")
        file_values = {k: v for k, v in file_values.items() if k in cls.model_fields}
    env = cls()  # reads EYRIE_* (only the fields the environment set count, even when equal to a default)
    env_values = env.model_dump(include=env.model_fields_set)
    merged = {**file_values, **env_values, **{k: v for k, v in flags.items() if v is not None}}
    return cls(**merged)


def _parse_env_file(text: str) -> dict:
    values = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            value = value.strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            values[key.strip().lower().removeprefix("eyrie_")] = value
    return values


__all__ = ["CommonSettings", "DecodeSettings", "Field", "PrefillSettings", "RouterSettings", "load_settings"]
