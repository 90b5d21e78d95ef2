"""The stack as ``eyrie up`` runs it, for the serving benchmark: an embedded Redis, then ``eyrie serve prefill``
and ``eyrie serve decode`` (both on the one device), then ``eyrie serve router`` with the OpenAI API, each its
own process, every port 0. A service is up when it prints its ready line (one JSON object on stdout, after
its engine loaded, captured its graphs and registered); its log (JSON lines on stderr) goes to
``log_dir/{role}.log``. Every wait has a deadline; ``stop`` (also run at exit) ends every process it started.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
LOG_TAIL_LINES, LOG_TAIL_WIDTH = 25, 600  # what a start-up failure quotes of the service's log


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of the file at ``path`` (each cut at ``LOG_TAIL_WIDTH`` characters), or a note
    that it could not be read."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 256 * 1024))  # a tail is enough; a log of many MB stays unread
            text = f.read().decode(errors="replace")
    except OSError as e:
        return f"(log unreadable: {e})"
    tail = text.splitlines()[-lines:]
    return "\n".join(x if len(x) <= LOG_TAIL_WIDTH else x[:LOG_TAIL_WIDTH] + " ..." for x in tail) or "(log empty)"


class ServiceProcess:
    def __init__(self, role: str, flags: list[str], env: dict, log_dir: Path, name: str | None = None):
        self.role, self.name = role, name or role  # name: "decode-2" for a layout's second decode instance
        self.log = open(log_dir / f"{self.name}.log", "ab")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", role, *flags], cwd=ROOT,
                                     env=env, stdout=subprocess.PIPE, stderr=self.log, start_new_session=True)
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)

    def ready(self, deadline: float) -> dict:
        """The service's ready line; raises if it exits or the deadline passes first."""
        while True:
            try:
                return json.loads(self._lines.get(timeout=0.2))
            except queue.Empty:
                pass
            except json.JSONDecodeError:
                continue
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with status {self.proc.returncode} while starting "
                                   f"(log: {self.log.name}); its last lines:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} printed no ready line in time (log: {self.log.name}); its last "
                                   f"lines:\n{self.log_tail()}")

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines of the service's log (each cut at ``LOG_TAIL_WIDTH`` characters)."""
        self.log.flush()
        return log_tail(Path(self.log.name), lines)

    def stop(self, grace_s: float = 10.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()
        return self.proc.returncode


class ServingStack:
    """Redis + prefill + decode + router; ``engine_flags`` go to prefill and decode (``--num-pages``, ...).
    ``instances``: the engine services as (role, their own flags: a device, a memory fraction), in start
    order, instead of one prefill and one decode; the second of a role is named ``{role}-2``, and so on."""

    def __init__(self, model: str, draft: str | None, engine_flags: dict, log_dir: Path,
                 prefill_flags: dict | None = None, decode_flags: dict | None = None, env: dict | None = None,
                 mps: str = "off", instances: list[tuple[str, dict]] | None = None):
        self.model, self.draft, self.engine_flags = model, draft, engine_flags
        self.mps, self.mps_daemon = mps, None  # as ``eyrie up --mps``: services/mps.py
        self.role_flags = {"prefill": prefill_flags or {}, "decode": decode_flags or {}}
        self.instances = instances if instances is not None else [("prefill", {}), ("decode", {})]
        self.log_dir = log_dir
        self.env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                    "EYRIE_PARENT_PID": str(os.getpid()), **(env or {})}
        self.redis = None
        self.procs: list[ServiceProcess] = []
        self.ready: dict[str, dict] = {}
        atexit.register(self.stop)

    def start(self, timeout_s: float) -> ServingStack:
        from services.metadata import EmbeddedRedis

        self.log_dir.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + timeout_s
        from services.mps import start_mps, want_mps

        control = want_mps(self.mps, str(self.engine_flags.get("device", "cpu")))
        if control is not None:
            self.mps_daemon = start_mps(control)
            self.env.update(self.mps_daemon.env)
        self.redis = EmbeddedRedis()
        redis = ["--redis-url", self.redis.start()]
        model = ["--model", self.model]
        try:
            engines = []
            for role, own in self.instances:
                k = sum(1 for p in engines if p.role == role) + 1
                flags = flag_list({"draft": self.draft, **self.engine_flags, **self.role_flags[role], **own})
                engines.append(self._spawn(role, [*redis, *model, *flags], role if k == 1 else f"{role}-{k}"))
            for p in engines:  # all load at once; each is registered by its ready line
                self.ready[p.name] = p.ready(deadline)
            router = self._spawn("router", [*redis, *model, "--openai-port", "0"])
            self.ready["router"] = router.ready(deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, role: str, flags: list[str], name: str | None = None) -> ServiceProcess:
        p = ServiceProcess(role, [*flags, "--grpc-port", "0", "--http-port", "0"], self.env, self.log_dir, name)
        self.procs.append(p)
        return p

    @property
    def grpc_address(self) -> str:
        return self.ready["router"]["grpc"]

    @property
    def openai_address(self) -> str:
        return self.ready["router"]["openai"]

    def metrics(self, role: str) -> str:
        with urllib.request.urlopen(f"http://{self.ready[role]['http']}/metrics", timeout=10) as r:
            return r.read().decode()

    def stop(self) -> dict[str, int | None]:
        codes = {p.name: p.stop() for p in self.procs}
        self.procs.clear()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        if self.mps_daemon is not None:
            self.mps_daemon.stop()
            self.mps_daemon = None
        return codes


def flag_list(flags: dict) -> list[str]:
    out = []
    for k, v in flags.items():
        if v is not None:
            out += [f"--{k.replace('_', '-')}", str(v).lower() if isinstance(v, bool) else str(v)]
    return out


def handoff_totals(metrics_text: str) -> dict[str, dict[str, float]]:
    """Per ``transport`` label: the hand-off bytes and seconds (sum, count) a service's /metrics counts."""
    out: dict[str, dict[str, float]] = {}
    names = {"eyrie_handoff_bytes_total": "bytes", "eyrie_handoff_seconds_sum": "seconds",
             "eyrie_handoff_seconds_count": "count"}
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name in names:
                t = out.setdefault(s.labels.get("transport", ""), {"bytes": 0.0, "seconds": 0.0, "count": 0.0})
                t[names[s.name]] += s.value
    return out


def local_prefills(metrics_text: str) -> float:
    """Prompts a decode service prefilled itself (``eyrie_local_prefills_total``)."""
    return sum(s.value for family in text_string_to_metric_families(metrics_text) for s in family.samples
               if s.name == "eyrie_local_prefills_total")


def handoff_delta(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """What moved between two ``handoff_totals``, with each transport's bandwidth (bytes over hand-off time:
    the whole hand-off, reserve and acknowledgement included)."""
    out = {}
    for transport, a in after.items():
        b = before.get(transport, {})
        d = {k: a[k] - b.get(k, 0.0) for k in a}
        if d["count"]:
            d["gbps"] = d["bytes"] / d["seconds"] / 1e9 if d["seconds"] > 0 else None
            out[transport] = d
    return out


LOOP_SERIES = {"eyrie_engine_loop_seconds_total": ("seconds", "part"), "eyrie_engine_steps_total": ("steps", "kind"),
               "eyrie_engine_step_decode_rows_total": ("rows", "kind")}


def loop_totals(metrics_text: str) -> dict:
    """An engine service's loop counters (``services.engine_loop.LoopTimes`` on /metrics): seconds by part, steps
    and decode rows by step kind, prompt tokens."""
    out: dict = {"seconds": {}, "steps": {}, "rows": {}, "prefill_tokens": 0.0}
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name in LOOP_SERIES:
                field, label = LOOP_SERIES[s.name]
                out[field][s.labels.get(label, "")] = s.value
            elif s.name == "eyrie_engine_step_prefill_tokens_total":
                out["prefill_tokens"] = s.value
    return out


def loop_delta(before: dict, after: dict, wall_s: float) -> dict:
    """What an engine service's loop did between two ``loop_totals`` over ``wall_s`` seconds: the share of the wall
    in steps (``busy``) and in calls between steps, and per step kind the steps, their mean time and mean decode
    rows (the counters advance after each step: a point's last idle stretch is not in them)."""
    gained = {f: {k: v - before[f].get(k, 0.0) for k, v in after[f].items()} for f in ("seconds", "steps", "rows")}
    steps = {k: int(n) for k, n in gained["steps"].items() if n > 0}
    secs = gained["seconds"]
    step_s = sum(v for k, v in secs.items() if k.startswith("step_"))
    return {"busy": round(step_s / wall_s, 3) if wall_s > 0 else None,
            "calls_share": round(secs.get("calls", 0.0) / wall_s, 4) if wall_s > 0 else None,
            "steps": steps,
            "step_ms": {k: round(1e3 * secs.get(f"step_{k}", 0.0) / n, 2) for k, n in steps.items()},
            "rows_mean": {k: round(gained["rows"].get(k, 0.0) / n, 1) for k, n in steps.items()},
            "prefill_tokens": int(after["prefill_tokens"] - before["prefill_tokens"])}
