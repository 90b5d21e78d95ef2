"""OpenAI-compatible HTTP on the router: ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models`` (and ``/v1/models/{id}``), ``GET /health``.

A thin translation layer over ``RouterCore``: every request becomes one ``pb.GenerateRequest`` and
walks the same path as a gRPC ``Generate`` call (validation, Redis records, placement, streaming), so
greedy output over HTTP equals greedy output over gRPC token for token.

Behaviour worth knowing (docs/deploy.md has the user-facing version):

- Stdlib ``ThreadingHTTPServer`` on its own thread, HTTP/1.1 keep-alive; streams are server-sent events
  (``data: {...}\\n\\n`` ... ``data: [DONE]\\n\\n``) in chunked transfer encoding.
- Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad request
  (``param`` names the OpenAI parameter at fault), 401 for a missing or wrong API key, 404 for an unknown
  route or model, 405 for a wrong method, 411/413 for a missing or oversized body, 503 when no instance
  can take the request, 500 otherwise. An error after a stream started arrives as one
  ``data: {"error": ...}`` event before ``[DONE]``.
- When ``settings.api_key`` is set, every route except ``/health`` needs ``Authorization: Bearer <key>``
  (the same key the gRPC API takes in its ``authorization`` metadata).
- Chat prompts are rendered with the model's chat template (``chat_template.jinja`` or
  ``tokenizer_config.json``'s ``chat_template``) in a sandboxed Jinja environment, the way Hugging Face
  renders it (``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``); a model without a
  template refuses chat requests.
- Sampling follows OpenAI's defaults (``temperature`` 1, ``top_p`` 1, ``max_tokens`` 16 for completions,
  up to the router's default for chat). Extensions: ``top_k``, ``stop_token_ids``, ``ignore_eos``,
  ``return_token_ids`` (adds ``token_ids`` to each choice); responses carry an ``eyrie`` object with the
  request id, speculative-decoding statistics and timings. Stop *strings* (``stop``), ``n`` > 1,
  penalties, ``logit_bias``, ``echo``, ``suffix``, tools and alternative log-probabilities are refused
  with a 400 naming the parameter rather than silently ignored.
"""

from __future__ import annotations

import json
import math
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc

from proto.eyrie.v1 import eyrie_pb2 as pb
from services.common import key_matches
from services.settings import RouterSettings
from shared.request import RequestError

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
UINT32_MAX, INT32_MAX, UINT64_MAX = 2**32 - 1, 2**31 - 1, 2**64 - 1

# RouterCore names fields after the gRPC message; clients know OpenAI's names.
_GRPC_TO_OPENAI = {
    "sampling.temperature": "temperature",
    "sampling.top_p": "top_p",
    "sampling.top_k": "top_k",
    "sampling.max_new_tokens": "max_tokens",
    "sampling.stop_token_ids": "stop_token_ids",
    "sampling.seed": "seed",
    "request": None,
    "request_id": None,
}

# A RouterError's gRPC code -> (HTTP status, OpenAI error type).
_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (503, "server_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error"),
    grpc.StatusCode.CANCELLED: (499, "invalid_request_error"),
}


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str | None, message: str, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def from_request_error(e: RequestError, prompt_param: str, max_tokens_param: str) -> ApiError:
    """RouterCore's field names (the gRPC message's) -> the OpenAI parameter the client sent."""
    name = e.field
    message = str(e).removeprefix(f"{name}: ")
    if name.startswith("prompt."):
        param = prompt_param
    elif name == "sampling.max_new_tokens":
        param = max_tokens_param
    else:
        param = _GRPC_TO_OPENAI.get(name, name)
    return bad(param, f"{param or name}: {message}")


def from_router_error(e: Exception) -> ApiError:
    code = getattr(e, "code", None)
    status, type_ = _STATUS.get(code, (500, "server_error"))
    name = code.name.lower() if isinstance(code, grpc.StatusCode) else "internal"
    return ApiError(status, getattr(e, "message", str(e)), code=name, type_=type_)


# ---- chat templates ------------------------------------------------------------------------------
class ChatTemplate:
    """The model's chat template, rendered like Hugging Face does (sandboxed Jinja, trim/lstrip blocks)."""

    def __init__(self, model_dir: str | Path | None, model_name: str = "eyrie"):
        self.source: str | None = None
        self.model_name = model_name
        self.bos_token, self.eos_token = "", ""
        self._compiled = None
        self._lock = threading.Lock()
        if model_dir is None:
            return
        model_dir = Path(model_dir)
        cfg = {}
        cfg_file = model_dir / "tokenizer_config.json"
        if cfg_file.exists():
            cfg = json.loads(cfg_file.read_text())
        self.bos_token, self.eos_token = _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))
        jinja_file = model_dir / "chat_template.jinja"  # newer checkpoints keep it beside the config
        template = jinja_file.read_text() if jinja_file.exists() else cfg.get("chat_template")
        if isinstance(template, list):  # the named-templates form: [{"name": "default", "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        self.source = template if isinstance(template, str) and template else None

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt of a chat request (``add_generation_prompt``: the assistant turn opens); without
        it, a whole conversation as text (what ``eyrie train-draft`` trains on)."""
        if self.source is None:
            raise bad("messages", f"messages: the model '{self.model_name}' has no chat template (neither "
                                  "chat_template.jinja nor a chat_template in tokenizer_config.json): send the "
                                  "prompt to /v1/completions", code="no_chat_template")
        with self._lock:
            if self._compiled is None:
                try:
                    self._compiled = self._compile(self.source)
                except Exception as e:  # the model's files are at fault, not the request
                    raise ApiError(500, f"the chat template of the model '{self.model_name}' does not compile: "
                                        f"{e}", code="bad_chat_template") from e
        try:
            return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except Exception as e:  # raise_exception() in the template, or a template bug
            raise bad("messages", f"messages: the chat template refused these messages: {e}",
                      code="chat_template_error") from e

    @staticmethod
    def _compile(source: str):
        # jinja2 comes with torch (a dependency of every Eyrie install); imported here so the router
        # starts even if the template is never used.
        from jinja2.exceptions import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            # Hugging Face's: Jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt.
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
        return env.from_string(source)


def _token_text(tok) -> str:
    if isinstance(tok, dict):  # {"content": "<s>", "lstrip": false, ...}
        return str(tok.get("content", ""))
    return tok if isinstance(tok, str) else ""


# ---- request parsing -----------------------------------------------------------------------------
@dataclass
class Parsed:
    """One OpenAI request, translated."""

    chat: bool
    req: pb.GenerateRequest
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    return_token_ids: bool = False
    prompt_param: str = "prompt"
    max_tokens_param: str = "max_tokens"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _get_bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"{name}: must be a boolean", code="invalid_type")
    return v


def _get_int(body: dict, name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v):
        raise bad(name, f"{name}: must be an integer", code="invalid_type")
    if not lo <= v <= hi:
        raise bad(name, f"{name}: must be in [{lo}, {hi}], got {v}")
    return v


def _get_number(body: dict, name: str) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_number(v) or not math.isfinite(v):
        raise bad(name, f"{name}: must be a finite number", code="invalid_type")
    return float(v)


def _refuse_unsupported(body: dict) -> None:
    """Parameters Eyrie does not implement: refuse them rather than return something else."""
    n = body.get("n")
    if n is not None and n != 1:
        raise bad("n", "n: only n=1 is supported (send one request per completion)", code="unsupported_value")
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise bad("best_of", "best_of: only 1 is supported", code="unsupported_value")
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        v = body.get(name)
        if v is not None and v != (1 if name == "repetition_penalty" else 0):
            raise bad(name, f"{name}: penalties are not supported", code="unsupported_parameter")
    if body.get("logit_bias"):
        raise bad("logit_bias", "logit_bias: not supported", code="unsupported_parameter")
    if body.get("echo"):
        raise bad("echo", "echo: not supported", code="unsupported_parameter")
    if body.get("suffix"):
        raise bad("suffix", "suffix: not supported", code="unsupported_parameter")
    for name in ("tools", "functions"):
        if body.get(name):
            raise bad(name, f"{name}: tool calling is not supported", code="unsupported_parameter")
    rf = body.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type", "text") == "text"):
        raise bad("response_format", "response_format: only {\"type\": \"text\"} is supported",
                  code="unsupported_value")
    stop = body.get("stop")
    if stop not in (None, "", []):
        raise bad("stop", "stop: stop strings are not supported; give token ids in stop_token_ids (an Eyrie "
                          "extension)", code="unsupported_parameter")


def _sampling(body: dict, max_tokens_param: str, default_max_tokens: int) -> pb.SamplingParams:
    s = pb.SamplingParams()
    temperature = _get_number(body, "temperature")
    s.temperature = 1.0 if temperature is None else temperature  # the router rejects < 0, naming it
    top_p = _get_number(body, "top_p")
    s.top_p = 1.0 if top_p is None else top_p
    if top_p is not None and top_p == 0:
        raise bad("top_p", "top_p: must be in (0, 1]")
    top_k = _get_int(body, "top_k", -1, INT32_MAX)
    s.top_k = 0 if top_k in (None, -1) else top_k  # -1 = off, as vLLM spells it
    seed = _get_int(body, "seed", 0, UINT64_MAX)
    if seed is not None:
        s.seed = seed
    max_tokens = _get_int(body, max_tokens_param, 1, UINT32_MAX)
    s.max_new_tokens = default_max_tokens if max_tokens is None else max_tokens
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list) or not all(_is_int(t) and -INT32_MAX <= t <= INT32_MAX for t in stop_ids):
            raise bad("stop_token_ids", "stop_token_ids: must be a list of token ids", code="invalid_type")
        s.stop_token_ids.extend(stop_ids)
    s.ignore_eos = _get_bool(body, "ignore_eos")
    return s


def _stream_options(body: dict, stream: bool) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not stream:
        raise bad("stream_options", "stream_options: only allowed with stream=true")
    if not isinstance(opts, dict):
        raise bad("stream_options", "stream_options: must be an object", code="invalid_type")
    return _get_bool(opts, "include_usage")


def parse_completion(body: dict) -> Parsed:
    _refuse_unsupported(body)
    req = pb.GenerateRequest()
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad("prompt", "prompt: must not be empty")
        req.text = prompt
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        if not all(-INT32_MAX <= t <= INT32_MAX for t in prompt):
            raise bad("prompt", "prompt: token id out of range")
        req.token_ids.ids.extend(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad("prompt", "prompt: batched prompts are not supported; send one prompt per request",
                  code="unsupported_value")
    elif prompt is None:
        raise bad("prompt", "prompt: required", code="missing_required_parameter")
    else:
        raise bad("prompt", "prompt: must be a string or a list of token ids", code="invalid_type")
    stream = _get_bool(body, "stream")
    logprobs = _get_int(body, "logprobs", 0, 20)
    if logprobs:
        raise bad("logprobs", "logprobs: only 0 is supported (the sampled token's log-probability, no "
                              "alternatives)", code="unsupported_value")
    req.sampling.CopyFrom(_sampling(body, "max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS))
    req.return_logprobs = logprobs is not None
    return Parsed(chat=False, req=req, stream=stream, include_usage=_stream_options(body, stream),
                  logprobs=req.return_logprobs, return_token_ids=_get_bool(body, "return_token_ids"))


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if messages is None:
        raise bad("messages", "messages: required", code="missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "messages: must be a non-empty list of {role, content} objects", code="invalid_type")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, f"{where}: must be an object", code="invalid_type")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise bad(f"{where}.role", f"{where}.role: must be system, developer, user, assistant or tool")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text
            texts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise bad(f"{where}.content[{j}]", f"{where}.content[{j}]: only text parts are supported",
                              code="unsupported_value")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise bad(f"{where}.content", f"{where}.content: must be a string or a list of text parts",
                      code="invalid_type")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def parse_chat(body: dict, template: ChatTemplate, default_max_tokens: int) -> Parsed:
    _refuse_unsupported(body)
    messages = _messages(body)
    stream = _get_bool(body, "stream")
    logprobs = _get_bool(body, "logprobs")
    top = _get_int(body, "top_logprobs", 0, 20)
    if top:
        raise bad("top_logprobs", "top_logprobs: only 0 is supported (the sampled token's log-probability)",
                  code="unsupported_value")
    max_param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    req = pb.GenerateRequest(text=template.render(messages), return_logprobs=logprobs)
    req.sampling.CopyFrom(_sampling(body, max_param, default_max_tokens))
    return Parsed(chat=True, req=req, stream=stream, include_usage=_stream_options(body, stream), logprobs=logprobs,
                  return_token_ids=_get_bool(body, "return_token_ids"), prompt_param="messages",
                  max_tokens_param=max_param)


# ---- responses -----------------------------------------------------------------------------------
@dataclass
class Accumulated:
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: pb.Finish | None = None


def _extension(rid: str, finish: pb.Finish) -> dict:
    sp = finish.spec
    return {"request_id": rid, "finish_reason": finish.reason, "ttft_s": round(finish.ttft_s, 6),
            "latency_s": round(finish.latency_s, 6),
            "spec": {"verify_steps": sp.verify_steps, "accepted_drafts": sp.accepted_drafts,
                     "accept_length": round(sp.accept_length, 6), "accept_rate": round(sp.accept_rate, 6),
                     "draft_time_s": round(sp.draft_time_s, 6), "verify_time_s": round(sp.verify_time_s, 6)}}


def _usage(finish: pb.Finish) -> dict:
    p, c = finish.usage.prompt_tokens, finish.usage.completion_tokens
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _finish_reason(finish: pb.Finish | None) -> str | None:
    """``stop`` / ``length`` as OpenAI spells them; Eyrie's ``abort`` / ``error`` pass through."""
    if finish is None:
        return None
    return finish.reason or "stop"


class OpenAIServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address, core, settings: RouterSettings):
        self.core, self.settings = core, settings
        self.template = ChatTemplate(settings.model, settings.model_name)
        self.created = int(time.time())
        super().__init__(address, OpenAIHandler)

    # The logprob of each token as text, for the logprobs blocks.
    def token_text(self, token_id: int) -> str:
        tok = self.core.tokenizer
        return tok.decode([token_id]) if tok is not None else ""


ROUTES = {"/v1/completions": ("POST",), "/v1/chat/completions": ("POST",), "/v1/models": ("GET",),
          "/health": ("GET",)}


class OpenAIHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: OpenAIServer
    server_version = "eyrie"

    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        self.server.core.log.debug("http_access", peer=self.address_string(), line=format % args)

    # ---- dispatch ----
    def do_GET(self):  # noqa: N802
        self._dispatch("GET")

    def do_POST(self):  # noqa: N802
        self._dispatch("POST")

    def do_PUT(self):  # noqa: N802
        self._dispatch("PUT")

    def do_DELETE(self):  # noqa: N802
        self._dispatch("DELETE")

    def do_PATCH(self):  # noqa: N802
        self._dispatch("PATCH")

    def _dispatch(self, method: str) -> None:
        self._body_read = False
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        try:
            if path == "/health":  # always open, like the telemetry /health and gRPC health
                self._check_method(method, ROUTES[path])
                self._send_json(200, {"status": "ready"})
                return
            self._authenticate()
            if path.startswith("/v1/models/"):
                self._check_method(method, ("GET",))
                self._model(path[len("/v1/models/"):])
                return
            if path not in ROUTES:
                raise ApiError(404, f"unknown route {method} {path}", code="unknown_route")
            self._check_method(method, ROUTES[path])
            if path == "/v1/models":
                self._send_json(200, {"object": "list", "data": [self._model_card()]})
                return
            body = self._read_json()
            self._check_model(body.get("model"))
            if path == "/v1/completions":
                self._generate(parse_completion(body))
            else:
                default = 0  # 0 = the router's default (capped by the room left in the context)
                self._generate(parse_chat(body, self.server.template, default))
        except ApiError as e:
            self._send_error(e)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # a bug here must not take the server thread down
            self.server.core.log.exception("http_error", method=method, path=path)
            self._send_error(ApiError(500, f"internal error: {e}", code="internal"))

    def _check_method(self, method: str, allowed: tuple[str, ...]) -> None:
        if method not in allowed:
            self._allow = ", ".join(allowed)
            raise ApiError(405, f"method {method} not allowed here (allowed: {self._allow})",
                           code="method_not_allowed")

    def _authenticate(self) -> None:
        api_key = self.server.settings.api_key
        if api_key and not key_matches(self.headers.get("Authorization"), api_key):
            raise ApiError(401, "missing or wrong API key (send Authorization: Bearer <key>)",
                           code="invalid_api_key")

    def _check_model(self, model) -> None:
        if model is None:
            return
        if not isinstance(model, str):
            raise bad("model", "model: must be a string", code="invalid_type")
        name = self.server.settings.model_name
        if model != name:
            raise ApiError(404, f"the model '{model}' does not exist (this server serves '{name}')", param="model",
                           code="model_not_found")

    def _model_card(self) -> dict:
        info = self.server.core.model_info()
        return {"id": info.model, "object": "model", "created": self.server.created, "owned_by": "eyrie",
                "max_model_len": info.max_context}

    def _model(self, model_id: str) -> None:
        card = self._model_card()
        if model_id != card["id"]:
            raise ApiError(404, f"the model '{model_id}' does not exist", param="model", code="model_not_found")
        self._send_json(200, card)

    def _read_json(self) -> dict:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            raise ApiError(411, "send the body with a Content-Length (chunked bodies are not accepted)",
                           code="length_required")
        length = self.headers.get("Content-Length")
        if length is None:
            raise ApiError(411, "a JSON body with a Content-Length is required", code="length_required")
        try:
            n = int(length)
        except ValueError:
            raise ApiError(400, "bad Content-Length", code="invalid_body") from None
        limit = self.server.settings.max_message_bytes
        if n > limit:
            raise ApiError(413, f"the body's {n} bytes exceed the limit of {limit}", code="body_too_large")
        raw = self.rfile.read(n)
        self._body_read = True
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object", code="invalid_json")
        return body

    # ---- generation ----
    def _generate(self, parsed: Parsed) -> None:
        rid = uuid.uuid4().hex
        parsed.req.request_id = rid
        core = self.server.core
        cancelled = threading.Event()
        gen = core.generate(parsed.req, cancelled)
        try:
            # Validation runs at the generator's first step: a bad request fails here, before any header.
            first = self._next(gen, parsed)
            if parsed.stream:
                self._stream(rid, parsed, gen, first)
            else:
                self._complete(rid, parsed, gen, first)
        except (BrokenPipeError, ConnectionResetError):
            core.log.event("client_gone", rid)
            self.close_connection = True
            core.abort(rid)
            raise
        finally:
            cancelled.set()
            gen.close()  # a generator left suspended is aborted (and recorded so) by RouterCore

    def _next(self, gen: Iterator[pb.GenerateResponse], parsed: Parsed) -> pb.GenerateResponse | None:
        from services.router.server import RouterError

        try:
            return next(gen)
        except StopIteration:
            return None
        except RequestError as e:
            raise from_request_error(e, parsed.prompt_param, parsed.max_tokens_param) from None
        except RouterError as e:
            raise from_router_error(e) from None

    def _complete(self, rid: str, parsed: Parsed, gen, first) -> None:
        acc = Accumulated()
        msg = first
        while msg is not None:
            acc.token_ids += msg.token_ids
            acc.text.append(msg.text)
            acc.logprobs += msg.logprobs
            if msg.HasField("finish"):
                acc.finish = msg.finish
            msg = self._next(gen, parsed)
        if acc.finish is None:
            raise ApiError(500, "the request ended without finishing", code="internal")
        text = "".join(acc.text)
        choice: dict = {"index": 0, "finish_reason": _finish_reason(acc.finish)}
        if parsed.chat:
            choice["message"] = {"role": "assistant", "content": text}
            choice["logprobs"] = self._chat_logprobs(acc.token_ids, acc.logprobs) if parsed.logprobs else None
        else:
            choice["text"] = text
            choice["logprobs"] = self._completion_logprobs(acc.token_ids, acc.logprobs, 0) \
                if parsed.logprobs else None
        if parsed.return_token_ids:
            choice["token_ids"] = acc.token_ids
        body = {"id": ("chatcmpl-" if parsed.chat else "cmpl-") + rid,
                "object": "chat.completion" if parsed.chat else "text_completion",
                "created": int(time.time()), "model": self.server.settings.model_name, "choices": [choice],
                "usage": _usage(acc.finish), "eyrie": _extension(rid, acc.finish)}
        self._send_json(200, body)

    def _stream(self, rid: str, parsed: Parsed, gen, first) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("X-Request-Id", rid)
        self.end_headers()
        base = {"id": ("chatcmpl-" if parsed.chat else "cmpl-") + rid,
                "object": "chat.completion.chunk" if parsed.chat else "text_completion",
                "created": int(time.time()), "model": self.server.settings.model_name}
        if parsed.chat:  # OpenAI opens a chat stream with the role
            self._event({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": None, "finish_reason": None}]}, parsed)
        offset = 0
        msg, finish = first, None
        try:
            while msg is not None:
                ids, lps = list(msg.token_ids), list(msg.logprobs)
                if msg.HasField("finish"):
                    finish = msg.finish
                if msg.text or finish is not None or parsed.logprobs or parsed.return_token_ids:
                    choice: dict = {"index": 0, "finish_reason": _finish_reason(finish)}
                    if parsed.chat:
                        choice["delta"] = {"content": msg.text} if msg.text or finish is None else {}
                        choice["logprobs"] = self._chat_logprobs(ids, lps) if parsed.logprobs else None
                    else:
                        choice["text"] = msg.text
                        choice["logprobs"] = self._completion_logprobs(ids, lps, offset) if parsed.logprobs else None
                    if parsed.return_token_ids:
                        choice["token_ids"] = ids
                    chunk = {**base, "choices": [choice]}
                    if finish is not None:
                        chunk["eyrie"] = _extension(rid, finish)
                    self._event(chunk, parsed)
                offset += len(msg.text)
                msg = self._next(gen, parsed)
            if finish is not None and parsed.include_usage:
                self._event({**base, "choices": [], "usage": _usage(finish)}, parsed)
        except ApiError as e:  # the headers are gone: report in the stream, as OpenAI-style servers do
            self._write_chunk(b"data: " + json.dumps(e.body()).encode() + b"\n\n")
        self._write_chunk(b"data: [DONE]\n\n")
        self._write_chunk(b"")

    def _event(self, payload: dict, parsed: Parsed) -> None:
        if parsed.include_usage:
            payload.setdefault("usage", None)
        self._write_chunk(b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n")

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _completion_logprobs(self, ids: list[int], lps: list[float], offset: int) -> dict:
        tokens = [self.server.token_text(t) for t in ids]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {"tokens": tokens, "token_logprobs": [float(x) for x in lps], "top_logprobs": None,
                "text_offset": offsets}

    def _chat_logprobs(self, ids: list[int], lps: list[float]) -> dict:
        content = []
        for t, lp in zip(ids, lps):
            text = self.server.token_text(t)
            content.append({"token": text, "logprob": float(lp), "bytes": list(text.encode()), "top_logprobs": []})
        return {"content": content}

    # ---- output ----
    def _send_json(self, status: int, body: dict, extra_headers: dict | None = None) -> None:
        data = json.dumps(body, ensure_ascii=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (extra_headers or {}).items():
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, e: ApiError) -> None:
        if e.status >= 500:
            self.server.core.log.warning("http_error", status=e.status, message=e.message,
                                         path=self.path.split("?", 1)[0])
        headers = {}
        if e.status == 401:
            headers["WWW-Authenticate"] = 'Bearer realm="eyrie"'
        if e.status == 405:
            headers["Allow"] = getattr(self, "_allow", "")
        if not self._body_read and self.command in ("POST", "PUT", "PATCH"):
            # The body was never read: the connection cannot be reused for another request.
            self.close_connection = True
        try:
            self._send_json(e.status, e.body(), headers)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True


def start_openai_server(core, settings: RouterSettings) -> tuple[OpenAIServer, int]:
    """Serve OpenAI-compatible HTTP for ``core`` on ``settings.host:settings.openai_port`` (0 = any free
    port), on a daemon thread. Stop with ``server.shutdown(); server.server_close()``."""
    server = OpenAIServer((settings.host, settings.openai_port or 0), core, settings)
    port = server.server_address[1]
    threading.Thread(target=server.serve_forever, name="router-openai-http", daemon=True).start()
    core.log.event("openai_http_started", address=f"{settings.host}:{port}")
    return server, port


__all__ = ["ApiError", "ChatTemplate", "OpenAIServer", "parse_chat", "parse_completion", "start_openai_server"]
