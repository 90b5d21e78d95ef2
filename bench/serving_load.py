"""The serving benchmark's workload and its drivers, measured one way on every side.

A ``Point`` is one measurement: a workload (prompt and output lengths, fixed or drawn from ranges), a
concurrency and a number of requests. Its requests are a pure function of the point (seeded), so the stack
and the engine get the same token ids. Every driver keeps ``concurrency`` requests in flight (a closed
loop: a finished request's place goes to the next), issues no new request after ``issue_s`` seconds, and
stamps each arrival of tokens with ``time.perf_counter``:

* TTFT: from sending the request to the first token's arrival;
* inter-token latency (ITL): the gap between two arrivals, divided evenly among the tokens the later one
  carries (a speculative step commits several tokens at once; each counts once);
* output tok/s: every output token of the point over the point's wall time (first send to last token).

Drivers: ``GrpcDriver`` (the router's streaming ``Generate``), ``HttpDriver`` (the OpenAI API's streaming
``/v1/completions``, standard library only), and ``run_engine_point`` (the engine in-process: requests
added at the same concurrency, ``Engine.step`` driven in a loop, as a user of the engine API would).
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass(frozen=True)
class Point:
    workload: str  # fixed | mixed | probe (the long-prompt TTFT probe) | warmup
    concurrency: int
    requests: int
    prompt: tuple[int, int]  # prompt length, inclusive range (lo == hi: fixed)
    output: tuple[int, int]  # output tokens, inclusive range
    seed: int = 0

    @property
    def name(self) -> str:
        return f"{self.workload}/c{self.concurrency}"

    @classmethod
    def from_dict(cls, d: dict) -> Point:
        return cls(**{**d, "prompt": tuple(d["prompt"]), "output": tuple(d["output"])})


@dataclass(frozen=True)
class RequestSpec:
    prompt_ids: list[int]
    max_new_tokens: int


def make_requests(point: Point, vocab: tuple[int, int], text_ids: list[int] | None = None) -> list[RequestSpec]:
    """The point's requests: random prompt ids in ``[vocab[0], vocab[1])`` and lengths, seeded by the point.
    With ``text_ids`` (a tokenized text), each prompt is a window of it at a random start instead: real text,
    which a trained draft can predict."""
    rng = random.Random(f"{point.workload}/{point.concurrency}/{point.requests}/{point.seed}")
    specs = []
    for _ in range(point.requests):
        n = rng.randint(*point.prompt)
        if text_ids:
            start = rng.randrange(max(1, len(text_ids) - n))
            ids = (text_ids * (n // len(text_ids) + 2))[start:start + n]
        else:
            ids = [rng.randrange(*vocab) for _ in range(n)]
        specs.append(RequestSpec(ids, rng.randint(*point.output)))
    return specs


@dataclass
class RequestRecord:
    """One request as its client saw it."""

    sent: float  # perf_counter at sending
    expected_tokens: int
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (perf_counter, tokens it carried)
    error: str = ""

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.arrivals)

    @property
    def ok(self) -> bool:
        return not self.error and self.tokens == self.expected_tokens

    @property
    def ttft(self) -> float | None:
        return self.arrivals[0][0] - self.sent if self.arrivals else None

    def itls(self) -> list[float]:
        out = []
        for (t0, _), (t1, n) in zip(self.arrivals, self.arrivals[1:]):
            out += [(t1 - t0) / n] * n
        return out


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(point: Point, records: list[RequestRecord]) -> dict:
    """The point's figures (seconds, tokens/s) from its requests' records."""
    done = [r for r in records if r.arrivals]
    start = min((r.sent for r in records), default=0.0)
    end = max((r.arrivals[-1][0] for r in done), default=start)
    tokens = sum(r.tokens for r in records)
    ttfts = [r.ttft for r in done]
    # The steady state: requests sent after the first ``concurrency`` (the first wave all arrive at once, so
    # their TTFTs measure the ramp, not the steady state).
    steady = [r.ttft for r in records[point.concurrency:] if r.arrivals]
    itls = [x for r in done for x in r.itls()]
    duration = end - start
    errors = sorted({r.error for r in records if r.error})
    return {"point": point.name, **asdict(point), "issued": len(records), "completed": sum(r.ok for r in records),
            "failed": sum(not r.ok for r in records), "errors": errors[:5], "duration_s": duration,
            "output_tokens": tokens, "output_tok_s": tokens / duration if duration > 0 else None,
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "ttft_steady_p50_s": percentile(steady, 50), "ttft_steady_p99_s": percentile(steady, 99),
            "itl_p50_s": percentile(itls, 50), "itl_p99_s": percentile(itls, 99),
            # per request, in issue order: [sent (s after the point's first send), TTFT (s), output tokens]
            "requests_detail": [[round(r.sent - start, 4), None if not r.arrivals else round(r.ttft, 4), r.tokens]
                                for r in records]}


# ---- the stack's clients -------------------------------------------------------------------------
def run_closed_loop(send: Callable[[RequestSpec, RequestRecord], None], specs: list[RequestSpec],
                    concurrency: int, issue_s: float,
                    new_record: Callable[[float, int], RequestRecord] = RequestRecord) -> list[RequestRecord]:
    """``concurrency`` threads each send the next request when their last one ended, until every spec was
    sent or ``issue_s`` passed; ``send`` fills the record (it must not raise). The records (``new_record(sent,
    expected_tokens)``: a subclass may carry more) come back in issue order, the specs' order."""
    records: list[RequestRecord] = []
    lock = threading.Lock()
    queue = iter(specs)
    deadline = time.perf_counter() + issue_s

    def worker() -> None:
        while time.perf_counter() < deadline:
            with lock:
                spec = next(queue, None)
                if spec is None:
                    return
                record = new_record(time.perf_counter(), spec.max_new_tokens)
                records.append(record)
            record.sent = time.perf_counter()
            send(spec, record)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records


class GrpcDriver:
    """The router's ``Generate`` stream; one channel per client thread (its own connection)."""

    def __init__(self, address: str, timeout_s: float):
        import grpc

        from proto.eyrie.v1 import eyrie_pb2 as pb
        from proto.eyrie.v1 import eyrie_pb2_grpc as pb_grpc

        self.pb, self.timeout_s = pb, timeout_s
        self._local = threading.local()
        self._make = lambda: pb_grpc.GenerationStub(grpc.insecure_channel(
            address, options=[("grpc.use_local_subchannel_pool", 1)]))

    def __call__(self, spec: RequestSpec, record: RequestRecord) -> None:
        pb = self.pb
        stub = getattr(self._local, "stub", None) or self._make()
        self._local.stub = stub
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=spec.prompt_ids), sampling=pb.SamplingParams(
            temperature=0.0, max_new_tokens=spec.max_new_tokens, ignore_eos=True))
        try:
            for msg in stub.Generate(req, timeout=self.timeout_s):
                if msg.token_ids:
                    record.arrivals.append((time.perf_counter(), len(msg.token_ids)))
        except Exception as e:  # grpc.RpcError and anything else: the record says why
            details = e.details() if callable(getattr(e, "details", None)) else str(e)
            record.error = f"{type(e).__name__}: {details}"


class HttpDriver:
    """The OpenAI API's streaming ``/v1/completions`` (server-sent events), with Eyrie's ``return_token_ids``
    so each chunk's tokens are counted exactly."""

    def __init__(self, address: str, timeout_s: float, model: str = "eyrie"):
        host, port = address.rsplit(":", 1)
        self.host, self.port, self.timeout_s, self.model = host, int(port), timeout_s, model

    def payload(self, spec: RequestSpec) -> dict:
        return {"model": self.model, "prompt": spec.prompt_ids, "max_tokens": spec.max_new_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True, "return_token_ids": True}

    def __call__(self, spec: RequestSpec, record: RequestRecord) -> None:
        body = json.dumps(self.payload(spec))
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        try:
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {resp.read(300)!r}"
                return
            self._read_events(resp, record)
        except Exception as e:
            record.error = f"{type(e).__name__}: {e}"
        finally:
            conn.close()

    def _read_events(self, resp, record: RequestRecord) -> None:
        while True:
            line = resp.readline()
            if not line:
                return
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                return
            event = json.loads(data)
            if "error" in event:
                record.error = f"stream error: {event['error'].get('message')}"
                return
            self.on_event(event, record)

    def on_event(self, event: dict, record: RequestRecord) -> None:
        """One streamed chunk: the tokens it carried, stamped."""
        n = sum(len(c.get("token_ids") or []) for c in event.get("choices", []))
        if n:
            record.arrivals.append((time.perf_counter(), n))


# ---- the engine in-process -----------------------------------------------------------------------
def run_engine_point(engine, specs: list[RequestSpec], concurrency: int, issue_s: float) -> list[RequestRecord]:
    """Requests added to ``engine`` at ``concurrency`` (closed loop), ``engine.step()`` until all ended."""
    from shared.sampling import SamplingParams

    pending, inflight, records = list(reversed(specs)), {}, []
    deadline = time.perf_counter() + issue_s
    while pending or inflight:
        while pending and len(inflight) < concurrency and time.perf_counter() < deadline:
            spec = pending.pop()
            record = RequestRecord(time.perf_counter(), spec.max_new_tokens)
            req = engine.add_request(spec.prompt_ids, SamplingParams(max_new_tokens=spec.max_new_tokens,
                                                                     ignore_eos=True))
            inflight[req.rid] = record
            records.append(record)
        if not inflight:
            break
        for req, tokens in engine.step():
            record = inflight.get(req.rid)
            if record is None:
                continue
            if tokens:
                record.arrivals.append((time.perf_counter(), len(tokens)))
            if req.finish_reason is not None:
                if req.finish_reason not in ("length", "stop"):
                    record.error = f"finished: {req.finish_reason}"
                del inflight[req.rid]
    return records
