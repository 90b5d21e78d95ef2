"""OpenAI-compatible HTTP on the router: ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models`` (and ``/v1/models/{id}``), ``GET /health``, on FastAPI under uvicorn
(``services.http_server``: backlog, head/body deadlines, body limit, bearer auth).

A thin translation layer over ``RouterCore``: every request becomes one ``pb.GenerateRequest`` and
walks the same path as a gRPC ``Generate`` call (validation, Redis records, placement, streaming), so
greedy output over HTTP equals greedy output over gRPC token for token.

Behaviour worth knowing (docs/deploy.md has the user-facing version):

- Request bodies are pydantic models that forbid unknown fields: a misspelt ``max_token`` is a 400 naming
  it, never a silent default. Accepted and ignored: ``user`` (OpenAI's end-user id) only.
- Streams are server-sent events (``data: {...}\\n\\n`` ... ``data: [DONE]\\n\\n``); a client that hangs up
  has its request aborted.
- Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad request
  (``param`` names the OpenAI parameter at fault), 401 for a missing or wrong API key, 404 for an unknown
  route or model, 405 for a wrong method, 408 for a body that does not arrive in time, 411/413 for a
  missing or oversized body, 415 for a body that is not JSON, 503 when no instance can take the request,
  500 otherwise. An error after a stream started arrives as one ``data: {"error": ...}`` event before
  ``[DONE]``. Refusals are logged (``http_refused``) and counted in ``eyrie_errors_total``.
- When ``settings.api_key`` is set, every route except ``/health`` needs ``Authorization: Bearer <key>``
  (the same key the gRPC API takes in its ``authorization`` metadata).
- Chat prompts are rendered with the model's chat template (``chat_template.jinja`` or
  ``tokenizer_config.json``'s ``chat_template``) in a sandboxed Jinja environment, the way Hugging Face
  renders it (``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``); a model without a
  template refuses chat requests.
- Sampling follows OpenAI's defaults (``temperature`` 1, ``top_p`` 1, ``max_tokens`` 16 for completions,
  up to the router's default for chat). Extensions: ``top_k``, ``stop_token_ids``, ``ignore_eos``,
  ``return_token_ids`` (adds ``token_ids`` to each choice), vLLM's ``include_stop_str_in_output``;
  responses carry an ``eyrie`` object with the request id, speculative-decoding statistics and timings.
  Stop strings (``stop``) cut the text before the first one to appear (the choice's ``stop_reason``
  names it) and nothing past it is streamed. Penalties and filters (``presence_penalty``,
  ``frequency_penalty``, ``logit_bias``, vLLM's ``repetition_penalty``, ``min_p``, ``min_tokens``,
  ``allowed_token_ids``) apply at every speculative tree node. ``response_format`` ``json_object`` and
  ``json_schema`` constrain the output to the schema (``shared/grammar.py``, every tree node masked from its
  own grammar state); vLLM's ``guided_*`` and ``structured_outputs`` spellings are refused, pointing to it.
  ``echo``, ``suffix``, tools, ``tool_choice``, alternative log-probabilities
  and vLLM's extras not implemented yet (``NOT_IMPLEMENTED``) are refused with a 400 naming the parameter
  rather than silently ignored.
- ``n`` choices on both endpoints (``services/router/choices.py``): each with its ``index``, its own
  ``finish_reason`` and, streamed, its own events (a chat stream opens each choice with its role); with a
  ``seed``, choice i samples with ``seed + i``. ``usage`` counts the prompt once and the returned choices'
  tokens. ``best_of`` (completions only, as OpenAI): ``best_of`` choices generated, the ``n`` of highest
  cumulative logprob returned, best first; below ``n``, or above ``n`` with ``stream``, is a 400 naming it.
  Both are capped by the router's ``max_n`` (a 400 naming the parameter and the limit).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import grpc
from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response, StreamingResponse

from proto.eyrie.v1 import eyrie_pb2 as pb
from services.http_server import HttpError, HttpServer, json_response, limit_headers, read_body, require_key
from services.router.session import Session
from services.settings import RouterSettings
from shared.grammar import ANY_JSON_OBJECT
from shared.request import RequestError

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
UINT32_MAX, INT32_MAX, UINT64_MAX = 2**32 - 1, 2**31 - 1, 2**64 - 1

# vLLM's sampling extras Eyrie does not implement yet: refused by name rather than silently ignored.
NOT_IMPLEMENTED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                   "structured_outputs", "bad_words", "prompt_logprobs",
                   "truncate_prompt_tokens", "length_penalty", "tool_choice",
                   "parallel_tool_calls", "skip_special_tokens", "spaces_between_special_tokens")
# vLLM's structured-output spellings: refused, their refusal points to OpenAI's response_format.
VLLM_STRUCTURED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")

# RouterCore names fields after the gRPC message; clients know OpenAI's names.
_GRPC_TO_OPENAI = {
    "sampling.temperature": "temperature",
    "sampling.top_p": "top_p",
    "sampling.top_k": "top_k",
    "sampling.max_new_tokens": "max_tokens",
    "sampling.stop_token_ids": "stop_token_ids",
    "sampling.seed": "seed",
    "sampling.stop": "stop",
    "sampling.min_tokens": "min_tokens",
    "sampling.logit_bias": "logit_bias",
    "sampling.allowed_token_ids": "allowed_token_ids",
    "sampling.json_schema": "response_format",
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

ApiError = HttpError  # the name this module's callers know


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
    status = getattr(e, "http_status", None) or status
    name = code.name.lower() if isinstance(code, grpc.StatusCode) else "internal"
    retry = getattr(e, "retry_after_s", None)
    headers = {"Retry-After": str(max(1, round(retry)))} if retry else None
    return ApiError(status, getattr(e, "message", str(e)), code=name, type_=type_, headers=headers)


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


# ---- request models ------------------------------------------------------------------------------
TokenId = Annotated[int, Field(ge=-INT32_MAX, le=INT32_MAX)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, the usage so far in every chunk too


class _Sampling(_Strict):
    """The parameters both endpoints take. Range checks that need the model (vocabulary, context) are
    RouterCore's; the ones here are the wire format's."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None  # -1 = off, as vLLM spells it
    seed: Annotated[int, Field(ge=0, le=UINT64_MAX)] | None = None
    max_tokens: Annotated[int, Field(ge=1, le=UINT32_MAX)] | None = None
    stop_token_ids: list[TokenId] | None = None  # Eyrie's extension: stop on these ids
    stop: str | list[str] | None = None  # stop strings: the text ends before the first to appear
    include_stop_str_in_output: bool = False  # vLLM's: keep the stop string at the end of the text
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's
    min_p: float | None = None  # vLLM's
    min_tokens: Annotated[int, Field(ge=0, le=UINT32_MAX)] | None = None  # vLLM's
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[TokenId] | None = None  # vLLM's
    ignore_eos: bool = False
    return_token_ids: bool = False  # Eyrie's extension: token_ids in each choice
    user: str | None = None  # OpenAI's end-user id: accepted, not used
    response_format: dict[str, Any] | None = None  # text, json_object or json_schema (_response_format)
    n: Annotated[int, Field(ge=1, le=UINT32_MAX)] | None = None  # choices (RouterCore caps them: max_n)
    best_of: Annotated[int, Field(ge=1, le=UINT32_MAX)] | None = None  # completions only (parse_chat refuses it)
    # Refused unless at their neutral value (_refuse_unsupported): declared so the message can say why.
    tools: list[Any] | None = None
    functions: list[Any] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]] | None = None
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool | None = None
    suffix: str | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=UINT32_MAX)] | None = None


_FIELDS = {name for m in (CompletionRequest, ChatRequest, ChatMessage, StreamOptions) for name in m.model_fields}


def _param(loc: tuple, unknown: bool = False) -> str:
    """pydantic's error location as the client wrote it: ``messages[0].role`` (union tags dropped; with
    ``unknown`` the last part is the client's unknown field, kept)."""
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _FIELDS or not out or (unknown and i == len(loc) - 1):
            out += f".{part}" if out else str(part)
        else:
            break
    return out


MAX_JSON_DEPTH = 32  # a request nests 4 levels deep (messages[i].content[j].text); far deeper is an attack
MAX_INT_DIGITS = 40  # any integer field's range fits in 20 digits; longer ones are refused, never converted


@dataclass(frozen=True)
class _HugeInt:
    """A JSON integer too long to convert (Python refuses int() past 4300 digits, and nothing needs it)."""

    digits: int


def _parse_int(text: str) -> int | _HugeInt:
    return int(text) if len(text) <= MAX_INT_DIGITS else _HugeInt(len(text.lstrip("-")))


def _check_json(body) -> None:
    """Refuse, naming the field, what the models cannot: lone surrogates (not Unicode), integers of
    thousands of digits, nesting past MAX_JSON_DEPTH. Iterative: a deep body must not recurse here."""
    stack: list[tuple[str, object, int]] = [("", body, 0)]
    while stack:
        where, value, depth = stack.pop()
        param = where.lstrip(".") or None
        if depth > MAX_JSON_DEPTH:
            raise bad(param, f"{param or 'the body'}: nested deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
        if isinstance(value, _HugeInt):
            raise bad(param, f"{param}: an integer of {value.digits} digits is out of range")
        if isinstance(value, str) and _is_surrogate(value):
            raise bad(param, f"{param}: not valid Unicode (a lone surrogate escape such as \\ud800)")
        elif isinstance(value, dict):
            for k, v in value.items():
                if not isinstance(k, str) or _is_surrogate(k):
                    raise bad(param, f"{param or 'the body'}: a key is not valid Unicode", code="invalid_json")
                stack.append((f"{where}.{k}", v, depth + 1))
        elif isinstance(value, list):
            stack.extend((f"{where}[{i}]", v, depth + 1) for i, v in enumerate(value))


def _is_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def validate(model: type[_Sampling], raw: bytes) -> _Sampling:
    """The body as ``model``: 400 naming the field for JSON that is not one (unknown fields included)."""
    try:
        body = json.loads(raw, parse_int=_parse_int)
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, f"the body is nested deeper than {MAX_JSON_DEPTH} levels", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    _check_json(body)
    for name in NOT_IMPLEMENTED:
        if name in body:
            hint = " (for JSON send response_format)" if name in VLLM_STRUCTURED else ""
            raise bad(name, f"{name}: not supported by Eyrie yet (refused rather than ignored){hint}",
                      code="unsupported_parameter")
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        err = e.errors()[0]
        param = _param(err["loc"], unknown=err["type"] == "extra_forbidden")
        if err["type"] == "extra_forbidden":
            raise bad(param, f"{param}: unknown parameter", code="unknown_parameter") from None
        if err["type"] == "missing":
            raise bad(param, f"{param}: required", code="missing_required_parameter") from None
        code = "invalid_value" if err["type"].endswith(("_than", "_than_equal", "literal_error")) else "invalid_type"
        raise bad(param, f"{param}: {err['msg']}", code=code) from None


# ---- request parsing -----------------------------------------------------------------------------
@dataclass
class Parsed:
    """One OpenAI request, translated."""

    chat: bool
    req: pb.GenerateRequest
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # usage in every streamed chunk (stream_options.continuous_usage_stats)
    logprobs: bool = False
    return_token_ids: bool = False
    prompt_param: str = "prompt"
    max_tokens_param: str = "max_tokens"
    n: int = 1  # choices returned


def _refuse_unsupported(body: _Sampling) -> None:
    """Parameters Eyrie does not implement: refuse them rather than return something else."""
    for name in ("echo", "suffix"):
        if getattr(body, name, None):
            raise bad(name, f"{name}: not supported", code="unsupported_parameter")
    for name in ("tools", "functions"):
        if getattr(body, name):
            raise bad(name, f"{name}: tool calling is not supported", code="unsupported_parameter")
    if body.stream_options is not None and not body.stream:
        raise bad("stream_options", "stream_options: only allowed with stream=true")


def _sampling(body: _Sampling, max_tokens: int | None, default_max_tokens: int) -> pb.SamplingParams:
    s = pb.SamplingParams()
    s.temperature = 1.0 if body.temperature is None else body.temperature  # the router rejects < 0, naming it
    s.top_p = 1.0 if body.top_p is None else body.top_p
    if body.top_p == 0:
        raise bad("top_p", "top_p: must be in (0, 1]")
    s.top_k = 0 if body.top_k in (None, -1) else body.top_k
    if body.seed is not None:
        s.seed = body.seed
    s.max_new_tokens = default_max_tokens if max_tokens is None else max_tokens
    s.stop_token_ids.extend(body.stop_token_ids or [])
    s.ignore_eos = body.ignore_eos
    s.stop.extend(x for x in ([body.stop] if isinstance(body.stop, str) else body.stop or []) if x)
    s.include_stop_str_in_output = body.include_stop_str_in_output
    _penalties(body, s)
    schema = _response_format(body.response_format)
    if schema is not None:
        s.json_schema = schema  # RouterCore checks it (a bad schema: 400 naming the problem)
    return s


def _response_format(rf: dict[str, Any] | None) -> str | None:
    """OpenAI's ``response_format`` as the JSON schema text the output must match (None: free text).
    ``json_schema``'s ``name`` and ``description`` are accepted and unused; the schema is always enforced
    (``strict`` or not: a constrained output is never worse than a hopeful one)."""
    kind = "text" if rf is None else rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ANY_JSON_OBJECT
    if kind != "json_schema":
        raise bad("response_format.type", f"response_format.type: {kind!r} is not one of text, json_object, "
                                          "json_schema", code="unsupported_value")
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise bad("response_format.json_schema", "response_format.json_schema: required, an object with the "
                                                 "schema", code="missing_required_parameter")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise bad("response_format.json_schema.schema", "response_format.json_schema.schema: required, a JSON "
                                                        "schema object", code="invalid_value")
    return json.dumps(schema)


def _penalties(body: _Sampling, s: pb.SamplingParams) -> None:
    """Penalties and filters (RouterCore checks the token ids against the vocabulary)."""
    for name, lo, hi in (("presence_penalty", -2, 2), ("frequency_penalty", -2, 2), ("min_p", 0, 1)):
        value = getattr(body, name)
        if value is not None and not lo <= value <= hi:
            raise bad(name, f"{name}: must be in [{lo}, {hi}]")
        setattr(s, name, value or 0.0)
    if body.repetition_penalty is not None and not 0 < body.repetition_penalty <= 10:
        raise bad("repetition_penalty", "repetition_penalty: must be in (0, 10]")
    s.repetition_penalty = body.repetition_penalty or 1.0
    s.min_tokens = body.min_tokens or 0
    for key, value in (body.logit_bias or {}).items():
        if not key.lstrip("-").isdigit() or not -INT32_MAX <= int(key) <= INT32_MAX:
            raise bad("logit_bias", f"logit_bias: {key!r} is not a token id")
        if not -100 <= value <= 100:
            raise bad("logit_bias", f"logit_bias: the bias of {key} must be in [-100, 100]")
        s.logit_bias[int(key)] = value
    s.allowed_token_ids.extend(body.allowed_token_ids or [])


def _include_usage(body: _Sampling) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


def _continuous_usage(body: _Sampling) -> bool:
    """As vLLM: only together with include_usage."""
    return _include_usage(body) and body.stream_options.continuous_usage_stats


def parse_completion(body: CompletionRequest) -> Parsed:
    _refuse_unsupported(body)
    req = pb.GenerateRequest()
    prompt = body.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad("prompt", "prompt: must not be empty")
        req.text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        if not all(-INT32_MAX <= t <= INT32_MAX for t in prompt):
            raise bad("prompt", "prompt: token id out of range")
        req.token_ids.ids.extend(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise bad("prompt", "prompt: batched prompts are not supported; send one prompt per request",
                  code="unsupported_value")
    elif prompt is None:
        raise bad("prompt", "prompt: required", code="missing_required_parameter")
    else:
        raise bad("prompt", "prompt: must be a string or a list of token ids", code="invalid_type")
    req.sampling.CopyFrom(_sampling(body, body.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS))
    req.sampling.top_logprobs = body.logprobs or 0
    req.return_logprobs = body.logprobs is not None
    req.n = body.n or 1
    if body.best_of is not None:
        if body.stream and body.best_of > req.n:  # OpenAI's rule: the best are known only at the end
            raise bad("best_of", f"best_of: {body.best_of} above n ({req.n}) cannot be streamed (the best choices "
                                 "are known only when all have ended)")
        req.best_of = body.best_of  # below n, or above max_n: RouterCore refuses it, naming it
    return Parsed(chat=False, req=req, stream=body.stream, include_usage=_include_usage(body),
                  continuous_usage=_continuous_usage(body), n=req.n,
                  logprobs=req.return_logprobs, return_token_ids=body.return_token_ids)


def _messages(body: ChatRequest) -> list[dict]:
    if body.messages is None:
        raise bad("messages", "messages: required", code="missing_required_parameter")
    if not body.messages:
        raise bad("messages", "messages: must be a non-empty list of {role, content} objects", code="invalid_type")
    out = []
    for i, m in enumerate(body.messages):
        where = f"messages[{i}]"
        content = m.content
        if isinstance(content, list):  # content parts: only text
            texts = []
            for j, part in enumerate(content):
                if not (part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise bad(f"{where}.content[{j}]", f"{where}.content[{j}]: only text parts are supported",
                              code="unsupported_value")
                texts.append(part["text"])
            content = "".join(texts)
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
    return out


def parse_chat(body: ChatRequest, template: ChatTemplate, default_max_tokens: int) -> Parsed:
    _refuse_unsupported(body)
    if body.best_of not in (None, 1):
        raise bad("best_of", "best_of: only /v1/completions takes it (OpenAI's chat API has no best_of)",
                  code="unsupported_parameter")
    messages = _messages(body)
    if body.top_logprobs and not body.logprobs:
        raise bad("top_logprobs", "top_logprobs: needs logprobs set to true", code="invalid_value")
    max_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    req = pb.GenerateRequest(text=template.render(messages), return_logprobs=body.logprobs)
    req.sampling.CopyFrom(_sampling(body, max_tokens, default_max_tokens))
    req.sampling.top_logprobs = body.top_logprobs or 0
    req.n = body.n or 1
    return Parsed(chat=True, req=req, stream=body.stream, include_usage=_include_usage(body), logprobs=body.logprobs,
                  continuous_usage=_continuous_usage(body), n=req.n,
                  return_token_ids=body.return_token_ids, prompt_param="messages", max_tokens_param=max_param)


# ---- responses -----------------------------------------------------------------------------------
@dataclass
class Accumulated:
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[pb.TopLogprobs] = field(default_factory=list)  # per token, when asked for
    finish: pb.Finish | None = None


def _extension(rid: str, finishes: list[pb.Finish]) -> dict:
    """The ``eyrie`` object: the request's id, timings and speculative-decoding statistics (of several
    choices: the first token's time, the last end, statistics over all of them; their finish reasons are the
    choices')."""
    finish = finishes[0] if len(finishes) == 1 else _combined(finishes)
    sp = finish.spec
    ext = {"request_id": rid, "finish_reason": finish.reason, "ttft_s": round(finish.ttft_s, 6),
           "latency_s": round(finish.latency_s, 6),
           "spec": {"verify_steps": sp.verify_steps, "accepted_drafts": sp.accepted_drafts,
                    "accept_length": round(sp.accept_length, 6), "accept_rate": round(sp.accept_rate, 6),
                    "draft_time_s": round(sp.draft_time_s, 6), "verify_time_s": round(sp.verify_time_s, 6)}}
    if len(finishes) > 1:
        del ext["finish_reason"]
    return ext


def _combined(finishes: list[pb.Finish]) -> pb.Finish:
    """Several choices' finishes as one: counts and times summed, rates weighted by each one's verify steps."""
    steps = sum(f.spec.verify_steps for f in finishes)

    def weighted(name: str) -> float:
        return sum(getattr(f.spec, name) * f.spec.verify_steps for f in finishes) / steps if steps else 0.0

    spec = pb.SpecStats(verify_steps=steps, accepted_drafts=sum(f.spec.accepted_drafts for f in finishes),
                        accept_length=weighted("accept_length"), accept_rate=weighted("accept_rate"),
                        draft_time_s=sum(f.spec.draft_time_s for f in finishes),
                        verify_time_s=sum(f.spec.verify_time_s for f in finishes))
    return pb.Finish(spec=spec, ttft_s=min(f.ttft_s for f in finishes), latency_s=max(f.latency_s for f in finishes))


def _usage(finishes: list[pb.Finish]) -> dict:
    """The prompt's tokens once, the choices' output tokens summed, and the prompt tokens found in a prefix cache
    (as OpenAI and vLLM report it): the fewest any choice found. The choices prefill their prompt once
    (``Scheduler._in_flight``): the one that computed it found only what was cached before the request, and which
    choice that is depends on the order they reached the instance, not on their index."""
    return {**_token_usage(finishes[0].usage.prompt_tokens, sum(f.usage.completion_tokens for f in finishes)),
            "prompt_tokens_details": {"cached_tokens": min(f.usage.cached_tokens for f in finishes)}}


def _token_usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _finish_reason(finish: pb.Finish | None) -> str | None:
    """``stop`` / ``length`` as OpenAI spells them; Eyrie's ``abort`` / ``error`` pass through."""
    if finish is None:
        return None
    return finish.reason or "stop"


def _stop_reason(finish: pb.Finish | None) -> str | None:
    """vLLM's ``stop_reason``: the stop string that ended the text (None otherwise)."""
    return finish.stop_str or None if finish is not None else None


class OpenAIServer:
    """The FastAPI app over ``core`` and the uvicorn server that runs it (``start()`` / ``stop()``)."""

    def __init__(self, core, settings: RouterSettings):
        self.core, self.settings = core, settings
        self.template = ChatTemplate(settings.model, settings.model_name)
        self.created = int(time.time())
        self.app = self._app()
        # A head still arriving in pieces is bounded by h11 (with room for the request line); a whole one here.
        self.http = HttpServer(self.app, settings.host, settings.openai_port or 0, name="router-openai-http",
                               head_timeout_s=settings.http_read_timeout_s,
                               max_incomplete_head_bytes=2 * settings.max_header_bytes + 16384,
                               reuse_port=settings.reuse_port)

    @property
    def port(self) -> int:
        return self.http.port

    def start(self) -> OpenAIServer:
        self.http.start(loop=self.core.ensure_loop())  # the core's loop: its sessions and channels live there
        return self

    def stop(self) -> None:
        self.http.stop()

    # The logprob of each token as text, for the logprobs blocks.
    def token_text(self, token_id: int) -> str:
        tok = self.core.tokenizer
        return tok.decode([token_id]) if tok is not None else ""

    # ---- routes ----
    def _app(self) -> FastAPI:
        app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
        require_key(app, self.settings.api_key, ("/health",))  # the gRPC interceptor counts its own refusals
        limit_headers(app, self.settings.max_header_bytes)  # added last: runs first, before the key check
        app.add_api_route("/health", self._health, methods=["GET"])
        app.add_api_route("/v1/models", self._models, methods=["GET"])
        app.add_api_route("/v1/models/{model_id:path}", self._model, methods=["GET"])
        app.add_api_route("/v1/completions", self._completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self._chat, methods=["POST"])
        app.add_exception_handler(HttpError, self._on_error)
        app.add_exception_handler(HTTPException, self._on_routing_error)
        app.add_exception_handler(Exception, self._on_bug)
        return app

    async def _health(self) -> Response:
        reason = self.core.not_ready
        if reason:
            return json_response({"status": "not_serving", "reason": reason}, 503)
        return json_response({"status": "ready"})

    async def _models(self) -> Response:
        return json_response({"object": "list", "data": [await self._model_card()]})

    async def _model(self, model_id: str) -> Response:
        card = await self._model_card()
        if model_id != card["id"]:
            raise ApiError(404, f"the model '{model_id}' does not exist", param="model", code="model_not_found")
        return json_response(card)

    async def _completions(self, request: Request) -> Response:
        body = await self._body(request, CompletionRequest)
        return await self._generate(parse_completion(body))

    async def _chat(self, request: Request) -> Response:
        body = await self._body(request, ChatRequest)
        default = 0  # 0 = the router's default (capped by the room left in the context)
        return await self._generate(parse_chat(body, self.template, default))

    async def _model_card(self) -> dict:
        info = await self.core._io(self.core.model_info)  # the registry (Redis): off the loop
        return {"id": info.model, "object": "model", "created": self.created, "owned_by": "eyrie",
                "max_model_len": info.max_context}

    async def _body(self, request: Request, model: type[_Sampling]) -> _Sampling:
        ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
        if ctype != "application/json":
            raise ApiError(415, f"the body must be application/json, not {ctype}", code="unsupported_media_type")
        body = validate(model, await read_body(request, self.settings.max_message_bytes,
                                                  self.settings.http_read_timeout_s))
        if body.model is not None and body.model != self.settings.model_name:
            raise ApiError(404, f"the model '{body.model}' does not exist (this server serves "
                                f"'{self.settings.model_name}')", param="model", code="model_not_found")
        return body

    # ---- errors ----
    async def _on_error(self, request: Request, e: HttpError) -> Response:
        if not e.counted:  # RouterCore logged and counted its own refusals
            self._count(e.code or "http_error")
            fields = dict(status=e.status, code=e.code, param=e.param, path=request.url.path)
            if e.status >= 500:
                self.core.log.warning("http_error", message=e.message, **fields)
            else:
                self.core.log.event("http_refused", message=e.message, **fields)
        return e.response()

    async def _on_routing_error(self, request: Request, e: HTTPException) -> Response:
        if e.status_code == 404:
            err = ApiError(404, f"unknown route {request.method} {request.url.path}", code="unknown_route")
        elif e.status_code == 405:
            err = ApiError(405, f"method {request.method} not allowed here (allowed: {(e.headers or {}).get('Allow')})",
                           code="method_not_allowed", headers=dict(e.headers or {}))
        else:
            err = ApiError(e.status_code, str(e.detail), code="http_error", headers=dict(e.headers or {}))
        return await self._on_error(request, err)

    async def _on_bug(self, request: Request, e: Exception) -> Response:
        self.core.log.exception("http_error", method=request.method, path=request.url.path)
        return await self._on_error(request, ApiError(500, f"internal error: {e}", code="internal"))

    def _count(self, kind: str) -> None:
        if self.core.telemetry is not None:
            self.core.telemetry.errors_total.labels(kind).inc()

    # ---- generation ----
    async def _generate(self, parsed: Parsed) -> Response:
        rid = uuid.uuid4().hex
        parsed.req.request_id = rid
        session = Session(self.core, parsed.req)
        try:
            # Validation runs first in the session: a bad request fails here, before any header.
            first = await self._next(session, parsed)
            if not parsed.stream:
                body = await self._complete(rid, parsed, session, first)
        except BaseException as e:
            self._gone(rid, session)
            if isinstance(e, HttpError):
                e.headers.setdefault("X-Request-Id", rid)
            raise
        if parsed.stream:
            headers = {"Cache-Control": "no-cache", "X-Request-Id": rid}
            return StreamingResponse(self._events(rid, parsed, session, first), headers=headers,
                                     media_type="text/event-stream; charset=utf-8")
        return json_response(body)

    def _gone(self, rid: str, session: Session) -> None:
        """After the response, or when the client went away first: a request still running is aborted (and
        recorded so) in its own task; nothing here waits (the caller may be cancelled)."""
        if session.cancel("client went away"):
            self.core.log.event("client_gone", rid)

    async def _next(self, session: Session, parsed: Parsed) -> pb.GenerateResponse | None:
        """What arrived since the last call, as one message (None at the end); errors as ApiError."""
        from services.router.server import RouterError

        try:
            return await session.next()
        except RequestError as e:
            err = from_request_error(e, parsed.prompt_param, parsed.max_tokens_param)
        except RouterError as e:
            err = from_router_error(e)
        err.counted = True
        raise err

    async def _complete(self, rid: str, parsed: Parsed, session: Session, first) -> dict:
        accs: dict[int, Accumulated] = {}
        msg = first
        while msg is not None:
            acc = accs.setdefault(msg.index, Accumulated())
            acc.token_ids += msg.token_ids
            acc.text.append(msg.text)
            acc.logprobs += msg.logprobs
            acc.top_logprobs += msg.top_logprobs
            if msg.HasField("finish"):
                acc.finish = msg.finish
            msg = await self._next(session, parsed)
        if sorted(accs) != list(range(parsed.n)) or any(acc.finish is None for acc in accs.values()):
            raise ApiError(500, "the request ended without finishing", code="internal")
        finishes = [accs[i].finish for i in range(parsed.n)]
        return {"id": ("chatcmpl-" if parsed.chat else "cmpl-") + rid,
                "object": "chat.completion" if parsed.chat else "text_completion",
                "created": int(time.time()), "model": self.settings.model_name,
                "choices": [self._choice(parsed, i, accs[i]) for i in range(parsed.n)],
                "usage": _usage(finishes), "eyrie": _extension(rid, finishes)}

    def _choice(self, parsed: Parsed, index: int, acc: Accumulated) -> dict:
        """One choice of a whole (not streamed) response."""
        text = "".join(acc.text)
        choice: dict = {"index": index, "finish_reason": _finish_reason(acc.finish),
                        "stop_reason": _stop_reason(acc.finish)}
        if parsed.chat:
            choice["message"] = {"role": "assistant", "content": text}
            choice["logprobs"] = self._chat_logprobs(acc.token_ids, acc.logprobs, acc.top_logprobs) \
                if parsed.logprobs else None
        else:
            choice["text"] = text
            choice["logprobs"] = self._completion_logprobs(acc.token_ids, acc.logprobs, 0, acc.top_logprobs) \
                if parsed.logprobs else None
        if parsed.return_token_ids:
            choice["token_ids"] = acc.token_ids
        return choice

    async def _events(self, rid: str, parsed: Parsed, session: Session, first):
        """The stream's server-sent events, ``[DONE]`` last; one event carries every token that arrived since
        the last one was written (the client reads slower than the engine writes: tokens coalesce)."""
        base = {"id": ("chatcmpl-" if parsed.chat else "cmpl-") + rid,
                "object": "chat.completion.chunk" if parsed.chat else "text_completion",
                "created": int(time.time()), "model": self.settings.model_name}
        # With continuous usage every chunk says the tokens so far (the prompt's counted as the router does).
        usage = {"prompt": len(self.core.validate(parsed.req)[1]) if parsed.continuous_usage else 0,
                 "completion": 0}
        try:
            for index in range(parsed.n if parsed.chat else 0):  # OpenAI opens each chat choice with the role
                yield _event({**base, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                   "logprobs": None, "finish_reason": None}]}, parsed, usage)
            async for chunk in self._chunks(rid, parsed, session, first, base, usage):
                yield chunk
            yield b"data: [DONE]\n\n"
        finally:
            self._gone(rid, session)  # a no-op once it ended

    async def _chunks(self, rid: str, parsed: Parsed, session: Session, first, base: dict, usage: dict):
        offsets: dict[int, int] = {}  # each choice's text so far (the completions logprobs' text_offset)
        finishes: dict[int, pb.Finish] = {}
        msg = first
        try:
            while msg is not None:
                finish = msg.finish if msg.HasField("finish") else None
                if finish is not None:
                    finishes[msg.index] = finish
                usage["completion"] += len(msg.token_ids)
                offset = offsets.get(msg.index, 0)
                if msg.text or finish is not None or parsed.logprobs or parsed.return_token_ids:
                    yield _event(self._chunk(base, parsed, msg, finish, offset, rid), parsed, usage)
                offsets[msg.index] = offset + len(msg.text)
                msg = await self._next(session, parsed)
            if len(finishes) == parsed.n and parsed.include_usage:
                yield _event({**base, "choices": [], "usage": _usage(list(finishes.values()))}, parsed)
        except ApiError as e:  # the headers are gone: report in the stream, as OpenAI-style servers do
            yield b"data: " + json.dumps(e.body()).encode() + b"\n\n"

    def _chunk(self, base: dict, parsed: Parsed, msg: pb.GenerateResponse, finish, offset: int, rid: str) -> dict:
        ids, lps, tops = msg.token_ids, msg.logprobs, msg.top_logprobs  # copied only where they go out
        choice: dict = {"index": msg.index, "finish_reason": _finish_reason(finish),
                        "stop_reason": _stop_reason(finish)}
        if parsed.chat:
            choice["delta"] = {"content": msg.text} if msg.text or finish is None else {}
            choice["logprobs"] = self._chat_logprobs(ids, lps, tops) if parsed.logprobs else None
        else:
            choice["text"] = msg.text
            choice["logprobs"] = self._completion_logprobs(ids, lps, offset, tops) if parsed.logprobs else None
        if parsed.return_token_ids:
            choice["token_ids"] = list(ids)
        chunk = {**base, "choices": [choice]}
        if finish is not None:
            chunk["eyrie"] = _extension(rid, [finish])
        return chunk

    def _completion_logprobs(self, ids: list[int], lps: list[float], offset: int,
                             tops: list[pb.TopLogprobs]) -> dict:
        """The completions shape: per token its text, logprob, offset and (with ``logprobs`` > 0) a
        {text: logprob} map of the most likely tokens."""
        tokens = [self.token_text(t) for t in ids]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        top = [{self.token_text(t): float(lp) for t, lp in zip(m.token_ids, m.logprobs)} for m in tops] or None
        return {"tokens": tokens, "token_logprobs": [float(x) for x in lps], "top_logprobs": top,
                "text_offset": offsets}

    def _chat_logprobs(self, ids: list[int], lps: list[float], tops: list[pb.TopLogprobs]) -> dict:
        """The chat shape: per token its text, logprob, bytes and (with ``top_logprobs``) the most likely
        tokens, each as {token, logprob, bytes}."""
        content = []
        for i, (t, lp) in enumerate(zip(ids, lps)):
            alts = [self._chat_entry(a, alp) for a, alp in zip(tops[i].token_ids, tops[i].logprobs)] \
                if i < len(tops) else []
            content.append({**self._chat_entry(t, lp), "top_logprobs": alts})
        return {"content": content}

    def _chat_entry(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": float(logprob), "bytes": list(text.encode())}


def _event(payload: dict, parsed: Parsed, usage: dict | None = None) -> bytes:
    """One server-sent event; ``usage`` ({prompt, completion} tokens so far) fills its usage with continuous
    usage stats, else a chunk's usage is null when include_usage asked for a last one."""
    if parsed.continuous_usage and usage is not None:
        payload.setdefault("usage", _token_usage(usage["prompt"], usage["completion"]))
    if parsed.include_usage:
        payload.setdefault("usage", None)
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


def start_openai_server(core, settings: RouterSettings) -> tuple[OpenAIServer, int]:
    """Serve OpenAI-compatible HTTP for ``core`` on ``settings.host:settings.openai_port`` (0 = any free
    port), on a daemon thread. Stop with ``server.stop()``."""
    server = OpenAIServer(core, settings).start()
    core.log.event("openai_http_started", address=f"{settings.host}:{server.port}")
    return server, server.port


__all__ = ["ApiError", "ChatRequest", "ChatTemplate", "CompletionRequest", "OpenAIServer", "parse_chat",
           "parse_completion", "start_openai_server", "validate"]
