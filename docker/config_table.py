"""The EYRIE_* configuration table of docs/deploy.md and README.md, generated from services/settings.py.

    python docker/config_table.py            # print the table
    python docker/config_table.py --write    # rewrite it between the markers, in docs/deploy.md and README.md
    python docker/config_table.py --check    # exit 1 if any of those tables is stale

A test runs the check, so the table cannot drift from the settings. A field's meaning is its
``Field(description=...)``, else its entry in DESCRIPTIONS below, else the comment at the end of its line in
services/settings.py; a field with none of them fails the check.
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "deploy.md"
README = ROOT / "README.md"
DOCS = (DOC, README)  # both must hold the table between the markers
START, END = "<!-- settings-table:start -->", "<!-- settings-table:end -->"

# One line per field name; where the router and the engines use a name differently, the line says so.
DESCRIPTIONS = {
    "redis_url": "Redis for the instance registry and request records (`redis://:PASSWORD@HOST:PORT/DB`)",
    "host": "address to bind (gRPC, `/health` + `/metrics`, OpenAI HTTP)",
    "advertise_host": "address other services dial, recorded in the registry (default: `host`; the images "
                      "default it to the container's IP)",
    "grpc_port": "gRPC port (0 = any free port)",
    "http_port": "`/health` and `/metrics` port (0 = any free port)",
    "instance_id": "name in the registry and in logs (default: role + random suffix)",
    "heartbeat_s": "seconds between registry heartbeats",
    "registry_ttl_s": "seconds a registry entry lives without a heartbeat",
    "log_level": "DEBUG, INFO, WARNING or ERROR",
    "model": "target checkpoint directory (the router reads only `config.json` and the tokenizer)",
    "draft": "draft head directory (EAGLE, EAGLE-3 or multi-layer); unset = no speculation",
    "device": "`cpu` or `cuda` (`cuda:N`)",
    "dtype": "`float32`, `bfloat16` or `float16`",
    "page_size": "tokens per KV page (prefill and decode must agree)",
    "num_pages": "KV pages per pool (default: enough for `max_running` requests of `max_context` tokens)",
    "max_running": "requests in the running batch at most",
    "max_context": "longest prompt + output in tokens (default: the model's)",
    "chunk_size": "prefill chunk length in tokens",
    "spec_topk": "draft tree: top-k per step (1 = chain)",
    "spec_steps": "draft tree: depth",
    "spec_draft_tokens": "draft tree: nodes verified per step (default: steps + 1 for a chain, 8 for a tree)",
    "cuda_graph": "capture decode, draft and verify in CUDA graphs",
    "spec_draft_ahead": "launch the next step's draft before this step's tokens reach the host, overlapping the "
                        "host's bookkeeping (unset = on with `cuda`)",
    "handoff_chunk_bytes": "largest KV chunk of the prefill -> decode hand-off",
    "handoff_timeout_s": "seconds a hand-off may take",
    "handoff_transport": "hand-off data transport: `auto` (ipc on one host, else grpc-stream), `ipc` or `grpc-stream`",
    "gpu_memory_fraction": "on a GPU without `num_pages`: the most of the device's total memory the engine takes "
                           "(weights, activation and graph reserve, KV pools), as vLLM's `gpu_memory_utilization`; "
                           "unset = 0.9 (`eyrie up` on a GPU: 0.45 for prefill and for decode)",
    "stream_attach_timeout_s": "a handed-off request nobody streams is aborted after this",
    "stream_idle_timeout_s": "a request that produces no token for this long is aborted",
    "default_max_new_tokens": "output length when a request gives none",
    "request_ttl_s": "seconds a finished, failed or aborted request's record stays in Redis",
    "max_message_bytes": "largest request (gRPC message or HTTP body)",
    "api_key": "when set, every gRPC call (the router's API, the internal prefill and decode services, server "
               "reflection) and every HTTP request (`/metrics`, the OpenAI API) needs `authorization: Bearer <key>`; "
               "`/health` and `grpc.health.v1` stay open. Give every service of a stack the same key: they call "
               "each other with it",
    "openai_port": "OpenAI-compatible HTTP port (unset = off; 0 = any free port)",
    "http_read_timeout_s": "an HTTP request's head, then its body, must arrive within this many seconds (else the "
                           "connection closes, or 408)",
    "placement_timeout_s": "seconds to wait for a prefill and a decode instance that can take a request",
    "stream_timeout_s": "deadline of one request's prefill and decode calls",
    "model_name": "the model's name in the OpenAI API (`model`) and in GetModelInfo",
}


def settings_classes() -> dict:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from services.settings import SETTINGS

    return SETTINGS


def source_comments() -> dict[str, str]:
    """Field name -> the comment ending its line in services/settings.py (the first one seen)."""
    source = (ROOT / "services" / "settings.py").read_text()
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    out: dict[str, str] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.lineno in comments:
            out.setdefault(node.target.id, comments[node.lineno])
    return out


def _default(field) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    return f"`{value}`"


def rows() -> list[tuple[str, str, str, str]]:
    """(variable, services, default, meaning) per field, in the settings' own order; a field whose default
    differs between services lists each."""
    seen: dict[str, dict] = {}
    for role, cls in settings_classes().items():
        for name, field in cls.model_fields.items():
            entry = seen.setdefault(name, {"roles": [], "defaults": {}, "description": field.description})
            entry["roles"].append(role)
            entry["defaults"][role] = _default(field)
    out = []
    comments = source_comments()
    for name, entry in seen.items():
        meaning = entry["description"] or DESCRIPTIONS.get(name) or comments.get(name)
        if not meaning:
            raise KeyError(f"settings field {name!r} has no description: give it Field(description=...) or a "
                           f"comment in services/settings.py, or an entry in docker/config_table.py DESCRIPTIONS")
        defaults = set(entry["defaults"].values())
        default = defaults.pop() if len(defaults) == 1 else ", ".join(
            f"{role}: {d}" for role, d in entry["defaults"].items())
        roles = "all" if len(entry["roles"]) == 3 else ", ".join(entry["roles"])
        out.append((f"`EYRIE_{name.upper()}`", roles, default, meaning))
    return out


def table() -> str:
    lines = ["| variable | services | default | meaning |", "| --- | --- | --- | --- |"]
    lines += [f"| {v} | {s} | {d} | {m} |" for v, s, d, m in rows()]
    return "\n".join(lines)


def current_table(doc: str, name: str = "the document") -> str:
    if START not in doc or END not in doc:
        raise ValueError(f"{name} lacks the markers {START} ... {END}")
    return doc.split(START, 1)[1].split(END, 1)[0].strip()


def documents() -> list[Path]:
    return list(DOCS)


def write() -> None:
    for path in documents():
        doc = path.read_text()
        head, rest = doc.split(START, 1)
        path.write_text(f"{head}{START}\n{table()}\n{END}{rest.split(END, 1)[1]}")


def main(argv: list[str]) -> int:
    if "--write" in argv:
        write()
    elif "--check" in argv:
        stale = [p for p in documents() if current_table(p.read_text(), p.name) != table()]
        for path in stale:
            print(f"{path} has a stale configuration table: run python docker/config_table.py --write",
                  file=sys.stderr)
        return 1 if stale else 0
    else:
        print(table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
