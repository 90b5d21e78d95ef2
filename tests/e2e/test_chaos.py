"""Chaos: two prefill and two decode processes under a steady load of greedy streaming requests while a
driver kills (``kill -9``) and restarts services and stops and restarts Redis at random moments (seeded).

Afterwards: every request the router accepted has a terminal record, every request that finished has
exactly the uninterrupted run's tokens (no stream saw a duplicate or a gap), every surviving pool is full.
The same check is shown to catch two planted bugs: a terminal write dropped while Redis is away, and a
failover that repeats the last token it sent. ``CHAOS_S`` sets the clean run's length (default 30 s: seed
18 puts five in it by 24 s: Redis, three decodes, a prefill; a longer run repeats the same kinds).
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proto.eyrie.v1 import eyrie_pb2 as pb
from proto.eyrie.v1 import eyrie_pb2_grpc as pb_grpc
from services.faults import HOLD_FILE_ENV
from services.metadata import TERMINAL, Registry, RequestStore, connect
from services.router.records import RecordWriter
from services.router.server import RouterCore, start_router
from services.settings import RouterSettings
from tests.e2e.test_failover import spawn
from tests.polling import poll
from tests.unit.services.scripted_stack import RestartableRedis

CHAOS_S = float(os.environ.get("CHAOS_S", "30"))
PROMPTS = [[(11 * i + j) % 500 + 3 for j in range(4 + 3 * i)] for i in range(6)]
NEW_TOKENS = 40
CLIENTS = 4


@dataclass
class Outcome:
    rid: str
    prompt: int
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    error: str | None = None


class ChaosStack:
    """Redis, 2 prefill + 2 decode processes and an in-process router; services and Redis can die and return."""

    def __init__(self, workdir, model_dir):
        self.model_dir = model_dir
        self.faults: list[str] = []  # what the random driver did
        self.redis = RestartableRedis(workdir).start()
        # A hand-off whose router relay died with a killed prefill holds its decode pages until nobody attaches
        # (30 s by default): 5 s here, so the end-of-run pool check waits out every orphan well within its bound.
        self.env = {**os.environ, "PYTHONPATH": os.getcwd(), "EYRIE_STREAM_ATTACH_TIMEOUT_S": "5"}
        self.gates = {name: workdir / f"hold-{name}" for name in ("decode-a", "decode-b")}  # services/faults.py
        self.procs = {name: self._spawn(name) for name in ("prefill-a", "prefill-b", "decode-a", "decode-b")}
        self.registry = Registry(connect(self.redis.url))
        self.wait_registered()
        self.router = start_router(RouterSettings(model=str(model_dir / "target"), redis_url=self.redis.url,
                                                  placement_timeout_s=15, heartbeat_s=0.2))
        self.core: RouterCore = self.router.extra["core"]
        self.stub = pb_grpc.GenerationStub(grpc.insecure_channel(self.router.grpc_address))
        self.reference = [self.generate(f"ref-{i}", i).tokens for i in range(len(PROMPTS))]

    def _spawn(self, name: str):
        gate = {HOLD_FILE_ENV: str(self.gates[name])} if name in self.gates else {}
        return spawn(name.split("-")[0], self.redis.url, self.model_dir, {**self.env, **gate})

    def wait_registered(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                live = self.registry.instances()
            except Exception:  # noqa: BLE001 (Redis still coming back)
                live = []
            if sum(i.role == "prefill" for i in live) >= 2 and sum(i.role == "decode" for i in live) >= 2:
                return
            assert time.monotonic() < deadline, f"services did not register: {live}"
            time.sleep(0.2)

    def generate(self, rid: str, prompt: int) -> Outcome:
        out = Outcome(rid, prompt)
        req = pb.GenerateRequest(request_id=rid, token_ids=pb.TokenIds(ids=PROMPTS[prompt]),
                                 sampling=pb.SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
        try:
            for msg in self.stub.Generate(req, timeout=120):
                out.tokens += msg.token_ids
                if msg.HasField("finish"):
                    out.finish = msg.finish.reason
        except grpc.RpcError as e:
            out.error = f"{e.code().name}: {e.details()}"
        return out

    # ---- faults ----
    def hold(self, timeout: float = 120) -> tuple[str, dict[str, int]]:
        """Arm both decodes' gates (``services/faults.py``) and wait until one holds a request decoding with two
        tokens out and more to come: its name and the requests held there, with their output tokens so far.
        Either one: on a loaded machine the router may send everything to one of them for a while."""
        for gate in self.gates.values():
            gate.touch()
        first: list[str] = []
        poll(lambda: first.extend(n for n, g in self.gates.items() if Path(f"{g}.held").exists()) or first,
             timeout, "no decode instance held a request mid-stream")
        return first[0], json.loads(Path(f"{self.gates[first[0]]}.held").read_text())

    def release(self) -> None:
        """Both decodes step on (and a restarted one is not held)."""
        for gate in self.gates.values():
            gate.unlink(missing_ok=True)
            Path(f"{gate}.held").unlink(missing_ok=True)

    def kill(self, name: str) -> None:
        os.kill(self.procs[name].pid, signal.SIGKILL)
        self.procs[name].wait()

    def restart(self, name: str) -> None:
        self.procs[name] = self._spawn(name)

    def heal(self) -> None:
        """Everything back: Redis, and a process for every dead service; then registered again."""
        if self.redis.proc is None:
            self.redis.start()
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                self.restart(name)
        self.wait_registered()

    def stop(self) -> None:
        self.router.stop(0.5)
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(15)
            except Exception:  # noqa: BLE001
                proc.kill()
        if self.redis.proc is not None:
            self.redis.stop()


def drive(stack: ChaosStack, duration_s: float, faults, seed: int, until_faults_end: bool = False) -> list[Outcome]:
    """``CLIENTS`` clients send requests back to back for ``duration_s`` while ``faults(stack, rng, stop)`` runs
    (``until_faults_end``: and on until a one-shot ``faults`` has acted, however long its state takes)."""
    outcomes: list[Outcome] = []
    stop = threading.Event()

    def client(k: int) -> None:
        rng, n = random.Random(seed * 100 + k), 0
        while not stop.is_set():
            n += 1
            out = stack.generate(f"s{seed}-c{k}-{n}", rng.randrange(len(PROMPTS)))
            outcomes.append(out)
            if out.error:
                time.sleep(0.2)

    clients = [threading.Thread(target=client, args=(k,)) for k in range(CLIENTS)]
    for t in clients:
        t.start()
    driver = threading.Thread(target=faults, args=(stack, random.Random(seed), stop))
    driver.start()
    stop.wait(duration_s)
    if until_faults_end:
        driver.join(300)
    stop.set()
    driver.join(60)
    assert not driver.is_alive(), "the fault driver did not end"
    for t in clients:
        t.join(180)
    stack.heal()
    return outcomes


def random_faults(stack: ChaosStack, rng: random.Random, stop: threading.Event) -> None:
    """Every 1.5-4 s one fault: kill -9 a prefill or a decode (restarted 2-4 s later), or Redis away 1-3 s."""
    while not stop.wait(rng.uniform(1.5, 4.0)):
        kind = rng.choice(["prefill", "decode", "redis"])
        stack.faults.append(kind)
        if kind == "redis":
            stack.redis.stop()
            stop.wait(rng.uniform(1.0, 3.0))
            stack.redis.start()
            continue
        name = f"{kind}-{rng.choice('ab')}"
        stack.kill(name)
        stop.wait(rng.uniform(2.0, 4.0))
        stack.restart(name)


def violations(stack: ChaosStack, outcomes: list[Outcome]) -> list[str]:
    """What broke the promises: records not terminal, tokens not the uninterrupted run's, pools not full."""
    deadline = time.monotonic() + 20
    while stack.core.records.buffered and time.monotonic() < deadline:
        time.sleep(0.1)
    store = RequestStore(connect(stack.redis.url))
    found = []
    for out in outcomes:
        rec = store.get(out.rid)
        if not rec:
            if out.error is None or "cannot record" not in out.error:
                found.append(f"{out.rid}: no record ({out.error or out.finish})")
            continue
        if rec["state"] not in TERMINAL:
            found.append(f"{out.rid}: record left {rec['state']} (client: {out.error or out.finish}, "
                         f"transitions {[t for t, _ in rec['transitions']]})")
        if out.finish is not None and out.tokens != stack.reference[out.prompt]:
            found.append(f"{out.rid}: tokens {out.tokens} != {stack.reference[out.prompt]}")
    deadline = time.monotonic() + 60  # an orphaned hand-off is aborted after the 5 s attach timeout
    while (used := pages_in_use(stack)) and time.monotonic() < deadline:
        time.sleep(0.2)
    found += [f"{name}: {n} KV pages still in use" for name, n in used.items()]
    return found


def pages_in_use(stack: ChaosStack) -> dict[str, float]:
    used = {}
    for inst in stack.registry.instances():
        try:
            text = httpx.get(f"http://{inst.http_address}/metrics", timeout=5).text
        except httpx.HTTPError:
            continue  # a killed instance whose entry has not expired yet: it holds nothing
        n = sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "eyrie_kv_pages_used")
        if n:
            used[inst.instance_id] = n
    return used


@pytest.fixture(scope="module")
def chaos_stack(tmp_path_factory, tiny_model_dir):
    stack = ChaosStack(tmp_path_factory.mktemp("chaos"), tiny_model_dir)
    yield stack
    stack.stop()


def test_chaos_loses_nothing_and_changes_no_token(chaos_stack):
    outcomes = drive(chaos_stack, CHAOS_S, random_faults, seed=18)
    finished = sum(o.finish is not None for o in outcomes)
    print(f"chaos {CHAOS_S:g} s: faults {chaos_stack.faults}; {len(outcomes)} requests, {finished} finished, "
          f"failovers {sum('failover' in str(chaos_stack.core.store.get(o.rid).get('placements')) for o in outcomes)}")
    assert len(chaos_stack.faults) >= 3 and finished >= 8, [o.error for o in outcomes]
    assert violations(chaos_stack, outcomes) == []


def _decode_dies_mid_stream(stack: ChaosStack, rng: random.Random, stop: threading.Event) -> None:
    """Kill a decode instance while it holds a request with tokens left to generate: its engine is held (a gate)
    once a request there has two tokens out, and the kill comes once the router has relayed them (a failover
    that resumes after them), whatever the machine's speed."""
    victim, held = stack.hold()
    poll(lambda: relayed(stack, held) >= 2, 120, f"the router never relayed two tokens of {held}")
    stack.kill(victim)
    stack.release()


def relayed(stack: ChaosStack, rids=None) -> int:
    """The most tokens the router has relayed to its client for any of ``rids`` (default: every request) still
    in flight."""
    with stack.core._lock:
        active = [stack.core._active.get(rid) for rid in (stack.core._active if rids is None else rids)]
    return max([a.output_tokens for a in active if a is not None], default=0)


def _redis_away_until_a_terminal_write_is_lost(lost: threading.Event, lost_writes: list, rounds: int = 5):
    """Stop Redis once streams are under way, and bring it back once a request has ended while it was away. A
    write whose answer the outage cut may have landed all the same (Redis took it, then went away: the record is
    right, nothing to catch; seen under load): then Redis goes away again, until a lost write did not land."""

    def unlanded(stack: ChaosStack) -> bool:
        store = RequestStore(connect(stack.redis.url))
        return any(store.get(rid).get("state") not in TERMINAL for rid, _ in list(lost_writes))

    def faults(stack: ChaosStack, rng: random.Random, stop: threading.Event) -> None:
        for _ in range(rounds):
            poll(lambda: relayed(stack) >= 2, 120, "no stream got under way")
            stack.redis.stop()
            lost.wait(120)
            stack.redis.start()
            if unlanded(stack):
                return
            lost.clear()
    return faults


def test_chaos_catches_a_duplicated_token_on_failover(chaos_stack, monkeypatch):
    place = RouterCore._place

    def forgetful(self, active, ids, params, t0, avoid, reason, resume, resume_logprobs):  # forgets the last one
        return place(self, active, ids, params, t0, avoid, reason, resume[:-1], resume_logprobs[:-1])

    monkeypatch.setattr(RouterCore, "_place", forgetful)
    found = violations(chaos_stack, drive(chaos_stack, 6, _decode_dies_mid_stream, seed=1, until_faults_end=True))
    assert any("tokens" in v for v in found), found


def test_chaos_catches_a_dropped_terminal_write(chaos_stack, monkeypatch):
    push, lost, lost_writes = RecordWriter._push, threading.Event(), []

    def lossy(self, write):  # terminal writes buffered during an outage are lost
        if write.state not in TERMINAL:
            push(self, write)
        else:
            lost_writes.append((write.rid, write.state))
            lost.set()

    monkeypatch.setattr(RecordWriter, "_push", lossy)
    outcomes = drive(chaos_stack, 6, _redis_away_until_a_terminal_write_is_lost(lost, lost_writes), seed=2,
                     until_faults_end=True)
    assert lost.is_set(), "no request ended while Redis was away"
    found = violations(chaos_stack, outcomes)
    # What the checker saw of each lost write's request, should it miss them all (a flake seen once under load).
    store, sent = RequestStore(connect(chaos_stack.redis.url)), {out.rid: out for out in outcomes}
    seen = {rid: (state, store.get(rid), sent.get(rid)) for rid, state in lost_writes}
    assert any("record left" in v for v in found), (found, seen)
