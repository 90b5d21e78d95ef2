"""The router: the clients' entry. Validates, records in Redis, places on a (prefill, decode) pair,
and streams tokens back.

Every request the router accepts ends in Redis as ``finished``, ``failed`` (with a reason) or
``aborted``; every transition is recorded with its time. A decode instance that cannot hold a request
(RESOURCE_EXHAUSTED from the hand-off) makes the router place it again on another instance; the first
token is held back until the hand-off succeeded, so a re-placed request streams each token once.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from proto.eyrie.v1 import eyrie_pb2 as pb
from proto.eyrie.v1 import eyrie_pb2_grpc as pb_grpc
from services.common import (
    ApiKeyInterceptor,
    ServiceHandle,
    full_name,
    new_instance_id,
    set_serving,
    start_grpc_server,
)
from services.settings import RouterSettings
from shared.handoff import sampling_from_pb
from shared.metadata import InstanceInfo, Registry, RequestStore, connect
from shared.model.config import ModelConfig
from shared.model.tokenizer import Tokenizer
from shared.request import RequestError
from shared.telemetry import Telemetry

log = logging.getLogger("eyrie.router")
SERVICES = [full_name("Generation")]
RID_PATTERN = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class RouterError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class Detokenizer:
    """Text deltas that never split a UTF-8 character (held back while the text ends in U+FFFD)."""

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer, self.ids, self.text = tokenizer, [], ""

    def push(self, ids: list[int], final: bool = False) -> str:
        if self.tokenizer is None:
            return ""
        self.ids += ids
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd") and not final:
            return ""
        delta, self.text = text[len(self.text):], text
        return delta


@dataclass
class Active:
    rid: str
    cancelled: threading.Event = field(default_factory=threading.Event)
    call: object | None = None
    prefill: InstanceInfo | None = None
    decode: InstanceInfo | None = None


class RouterCore:
    def __init__(self, settings: RouterSettings, store: RequestStore, registry: Registry,
                 tokenizer: Tokenizer | None, model_config: ModelConfig, telemetry: Telemetry | None = None):
        self.settings, self.store, self.registry = settings, store, registry
        self.tokenizer, self.model_config, self.telemetry = tokenizer, model_config, telemetry
        self.max_context = min(settings.max_context or model_config.max_position_embeddings,
                               model_config.max_position_embeddings)
        self._active: dict[str, Active] = {}
        self._lock = threading.Lock()
        self._inflight: dict[str, int] = defaultdict(int)  # instance -> tokens this router placed there
        self._channels: dict[str, grpc.Channel] = {}

    # ---- validation ------------------------------------------------------------------------------
    def validate(self, req: pb.GenerateRequest) -> tuple[str, list[int], object]:
        limit = self.settings.max_message_bytes
        if req.ByteSize() > limit:
            raise RequestError("request", f"{req.ByteSize()} bytes exceed the limit of {limit}")
        rid = req.request_id or uuid.uuid4().hex
        if not RID_PATTERN.match(rid):
            raise RequestError("request_id", "must be 1-128 characters of letters, digits, '.', '_', ':' or '-'")
        kind = req.WhichOneof("prompt")
        if kind is None:
            raise RequestError("prompt", "give text or token_ids")
        if kind == "text":
            if self.tokenizer is None:
                raise RequestError("prompt.text", "this router has no tokenizer: send token_ids")
            ids = self.tokenizer.encode(req.text)
        else:
            ids = list(req.token_ids.ids)
        field_name = f"prompt.{kind}"
        vocab = self.model_config.vocab_size
        if not ids:
            raise RequestError(field_name, "the prompt is empty")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(field_name, f"token id {bad} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_context:
            raise RequestError(field_name, f"{len(ids)} tokens do not fit the context of {self.max_context}")
        s = req.sampling
        if not math.isfinite(s.temperature) or s.temperature < 0:
            raise RequestError("sampling.temperature", "must be a finite number >= 0")
        if not math.isfinite(s.top_p) or not 0 <= s.top_p <= 1:
            raise RequestError("sampling.top_p", "must be in (0, 1] (0 means unset)")
        if s.top_k < 0:
            raise RequestError("sampling.top_k", "must be >= 0 (0 disables it)")
        room = self.max_context - len(ids)
        if s.max_new_tokens > room:
            raise RequestError("sampling.max_new_tokens",
                               f"{s.max_new_tokens} new tokens after a {len(ids)}-token prompt exceed the context "
                               f"of {self.max_context}")
        bad = next((t for t in s.stop_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError("sampling.stop_token_ids", f"token id {bad} is outside the vocabulary [0, {vocab})")
        params = sampling_from_pb(s, default_max_new_tokens=min(self.settings.default_max_new_tokens, room))
        return rid, ids, params

    # ---- placement -------------------------------------------------------------------------------
    def _pick(self, role: str, exclude: set[str]) -> InstanceInfo | None:
        live = [i for i in self.registry.instances(role) if i.instance_id not in exclude]
        if not live:
            return None
        with self._lock:
            return min(live, key=lambda i: (i.outstanding_tokens + self._inflight[i.instance_id], i.instance_id))

    def _stub(self, cls, address: str):
        with self._lock:
            ch = self._channels.get(address)
            if ch is None:
                ch = self._channels[address] = grpc.insecure_channel(address)
        return cls(ch)

    def _account(self, inst: InstanceInfo | None, tokens: int) -> None:
        if inst is not None:
            with self._lock:
                self._inflight[inst.instance_id] += tokens

    # ---- the request's walk ----------------------------------------------------------------------
    def generate(self, req: pb.GenerateRequest, cancelled: threading.Event | None = None
                 ) -> Iterator[pb.GenerateResponse]:
        rid, ids, params = self.validate(req)
        with self._lock:
            if rid in self._active or self.store.exists(rid):
                raise RequestError("request_id", f"{rid!r} already exists")
            active = self._active[rid] = Active(rid, cancelled or threading.Event())
        self.store.create(rid, prompt_tokens=len(ids), max_new_tokens=params.max_new_tokens)
        t0 = time.perf_counter()
        try:
            yield from self._walk(active, ids, params, req.return_logprobs, t0)
        except RouterError as e:
            state = "aborted" if active.cancelled.is_set() else "failed"
            self.store.transition(rid, state, error=e.message)
            if self.telemetry:
                self.telemetry.requests_total.labels(state).inc()
                self.telemetry.errors_total.labels(e.code.name.lower()).inc()
            self._abort_remote(active)
            raise
        except GeneratorExit:  # the caller stopped reading (client went away)
            self.store.transition(rid, "aborted", error="client went away")
            self._abort_remote(active)
            raise
        except Exception as e:
            log.exception("request failed", extra={"rid": rid})
            self.store.transition(rid, "failed", error=f"internal: {e}")
            self._abort_remote(active)
            raise RouterError(grpc.StatusCode.INTERNAL, f"internal error: {e}") from e
        finally:
            with self._lock:
                self._active.pop(rid, None)

    def _walk(self, active: Active, ids: list[int], params, return_logprobs: bool, t0: float):
        rid = active.rid
        detok = Detokenizer(self.tokenizer)
        deadline = time.monotonic() + self.settings.placement_timeout_s
        refused: set[str] = set()
        first = None
        while first is None:
            self._check_cancelled(active)
            prefill, decode = self._pick("prefill", set()), self._pick("decode", refused)
            if prefill is None or decode is None:
                if time.monotonic() > deadline:
                    missing = "prefill" if prefill is None else "decode"
                    raise RouterError(grpc.StatusCode.UNAVAILABLE, f"no {missing} instance can take the request")
                time.sleep(0.05)
                continue
            active.prefill, active.decode = prefill, decode
            self.store.transition(rid, "prefilling", prefill_instance=prefill.instance_id,
                                  decode_instance=decode.instance_id)
            first = self._prefill(active, ids, params, prefill, decode, refused, deadline)
        token, logprob, finish_reason = first
        ttft = time.perf_counter() - t0
        if self.telemetry:
            self.telemetry.ttft_seconds.observe(ttft)
        out = pb.GenerateResponse(request_id=rid, token_ids=[token], text=detok.push([token], bool(finish_reason)))
        if return_logprobs:
            out.logprobs.append(logprob)
        n_out = 1
        if finish_reason:
            out.finish.CopyFrom(pb.Finish(reason=finish_reason, usage=pb.Usage(prompt_tokens=len(ids),
                                          completion_tokens=1), ttft_s=ttft, latency_s=ttft))
            self._finished(rid, out.finish)
            yield out
            return
        yield out
        stream = self._stub(pb_grpc.DecodeStub, active.decode.grpc_address).Stream(
            pb.StreamRequest(request_id=rid), timeout=self.settings.stream_timeout_s)
        active.call = stream
        self._account(active.decode, params.max_new_tokens)
        try:
            for msg in stream:
                n_out += len(msg.token_ids)
                final = msg.HasField("finish")
                out = pb.GenerateResponse(request_id=rid, token_ids=msg.token_ids,
                                          text=detok.push(list(msg.token_ids), final))
                if return_logprobs:
                    out.logprobs.extend(msg.logprobs)
                if final:
                    out.finish.CopyFrom(msg.finish)
                    out.finish.ttft_s, out.finish.latency_s = ttft, time.perf_counter() - t0
                    out.finish.usage.prompt_tokens, out.finish.usage.completion_tokens = len(ids), n_out
                    self._finished(rid, out.finish)
                    yield out
                    return
                yield out
        except grpc.RpcError as e:
            self._check_cancelled(active)
            raise RouterError(grpc.StatusCode.UNAVAILABLE if e.code() != grpc.StatusCode.CANCELLED else e.code(),
                              f"decode instance {active.decode.instance_id}: {e.code().name}: {e.details()}") from e
        finally:
            self._account(active.decode, -params.max_new_tokens)
        raise RouterError(grpc.StatusCode.UNAVAILABLE, f"decode instance {active.decode.instance_id} ended the "
                                                       "stream without finishing the request")

    def _prefill(self, active: Active, ids, params, prefill: InstanceInfo, decode: InstanceInfo,
                 refused: set[str], deadline: float):
        """Run the prefill + hand-off; returns (first token, logprob, finish reason) or None to re-place."""
        from shared.handoff import sampling_to_pb

        rid = active.rid
        call = self._stub(pb_grpc.PrefillStub, prefill.grpc_address).Prefill(
            pb.PrefillRequest(request_id=rid, prompt_ids=ids, sampling=sampling_to_pb(params),
                              decode_address=decode.grpc_address), timeout=self.settings.stream_timeout_s)
        active.call = call
        first = None
        self._account(prefill, len(ids))
        try:
            for ev in call:
                if ev.HasField("first_token"):
                    ft = ev.first_token
                    first = (ft.token_id, ft.logprob, ft.finish_reason)
                    if ft.finish_reason:
                        return first
                    self.store.transition(rid, "transferring")
                elif ev.HasField("handed_off"):
                    self.store.transition(rid, "decoding", handoff_bytes=ev.handed_off.bytes,
                                          handoff_s=round(ev.handed_off.seconds, 6))
                    return first
        except grpc.RpcError as e:
            self._check_cancelled(active)
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline:
                log.info("decode %s refused; placing again", decode.instance_id, extra={"rid": rid})
                refused.add(decode.instance_id)
                if len(refused) >= len(self.registry.instances("decode")):
                    refused.clear()  # every instance refused: wait for room on any of them
                    time.sleep(0.1)
                return None
            code = e.code() if e.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT) \
                else grpc.StatusCode.UNAVAILABLE
            raise RouterError(code, f"prefill instance {prefill.instance_id}: {e.code().name}: {e.details()}") from e
        finally:
            self._account(prefill, -len(ids))
        raise RouterError(grpc.StatusCode.UNAVAILABLE, f"prefill instance {prefill.instance_id} ended early")

    def _check_cancelled(self, active: Active) -> None:
        if active.cancelled.is_set():
            raise RouterError(grpc.StatusCode.CANCELLED, "aborted")

    def _finished(self, rid: str, finish: pb.Finish) -> None:
        self.store.transition(rid, "finished", finish_reason=finish.reason,
                              output_tokens=finish.usage.completion_tokens,
                              accept_length=round(finish.spec.accept_length, 4),
                              accept_rate=round(finish.spec.accept_rate, 4))
        if self.telemetry:
            self.telemetry.requests_total.labels("finished").inc()
            self.telemetry.stage_seconds.labels("total").observe(finish.latency_s)
            if finish.spec.verify_steps:
                self.telemetry.accept_length.observe(finish.spec.accept_length)
                self.telemetry.accept_rate.observe(finish.spec.accept_rate)

    # ---- aborts ----------------------------------------------------------------------------------
    def abort(self, rid: str) -> bool:
        with self._lock:
            active = self._active.get(rid)
        if active is None:
            return False
        active.cancelled.set()
        if active.call is not None:
            active.call.cancel()
        return True

    def _abort_remote(self, active: Active) -> None:
        for inst, cls in ((active.prefill, pb_grpc.PrefillStub), (active.decode, pb_grpc.DecodeStub)):
            if inst is None:
                continue
            try:
                self._stub(cls, inst.grpc_address).Abort(pb.AbortRequest(request_id=active.rid), timeout=2)
            except grpc.RpcError:
                pass  # that instance is gone; its pages went with it

    def model_info(self) -> pb.ModelInfo:
        mc = self.model_config
        return pb.ModelInfo(model=self.settings.model_name, vocab_size=mc.vocab_size, max_context=self.max_context,
                            eos_token_ids=list(mc.eos_token_ids))

    def close(self) -> None:
        for ch in self._channels.values():
            ch.close()


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, core: RouterCore):
        self.core = core

    def Generate(self, request: pb.GenerateRequest, context):  # noqa: N802
        if not request.request_id:
            request.request_id = uuid.uuid4().hex
        cancelled = threading.Event()
        rid = request.request_id
        context.add_callback(lambda: cancelled.is_set() or self.core.abort(rid))
        try:
            for msg in self.core.generate(request, cancelled):
                if not context.is_active():
                    return
                yield msg
        except RequestError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RouterError as e:
            context.abort(e.code, e.message)
        finally:
            cancelled.set()

    def Abort(self, request: pb.AbortRequest, context):  # noqa: N802
        return pb.AbortResponse(found=self.core.abort(request.request_id))

    def GetModelInfo(self, request, context):  # noqa: N802
        return self.core.model_info()


def start_router(settings: RouterSettings) -> ServiceHandle:
    instance_id = settings.instance_id or new_instance_id("router")
    telemetry = Telemetry("router", instance_id, settings.host, settings.http_port).start()
    if not settings.model:
        raise RequestError("model", "the router needs the model directory (config.json, tokenizer.json)")
    model_dir = Path(settings.model)
    tokenizer = Tokenizer(model_dir) if (model_dir / "tokenizer.json").exists() else None
    client = connect(settings.redis_url)
    core = RouterCore(settings, RequestStore(client, settings.request_ttl_s), Registry(client, settings.registry_ttl_s),
                      tokenizer, ModelConfig.from_dir(model_dir), telemetry)
    interceptors = [ApiKeyInterceptor(settings.api_key)] if settings.api_key else []
    server, port, health = start_grpc_server(
        settings.host, settings.grpc_port, [(pb_grpc.add_GenerationServicer_to_server, GenerationServicer(core))],
        SERVICES, max_message_bytes=4 * settings.max_message_bytes, interceptors=interceptors)
    extra = {"core": core, "telemetry": telemetry}
    openai_server = None
    if settings.openai_port is not None:
        try:
            from services.router.openai_http import start_openai_server
        except ImportError:
            log.warning("OpenAI-compatible HTTP is not available in this build")
        else:
            openai_server, openai_port = start_openai_server(core, settings)
            extra["openai_address"] = f"{settings.advertised}:{openai_port}"
    set_serving(health, SERVICES, True)
    telemetry.set_state("ready")
    grpc_address = f"{settings.advertised}:{port}"
    log.info("router %s serving gRPC on %s, HTTP on %s", instance_id, grpc_address, telemetry.address)

    def stop(grace: float = 2.0) -> None:
        telemetry.set_state("draining")
        set_serving(health, SERVICES, False)
        if openai_server is not None:
            openai_server.shutdown()
            openai_server.server_close()
        server.stop(grace).wait(grace + 1)
        core.close()
        telemetry.stop()

    return ServiceHandle(role="router", instance_id=instance_id, grpc_address=grpc_address,
                         http_address=f"{settings.advertised}:{telemetry.port}", stop=stop, extra=extra)
