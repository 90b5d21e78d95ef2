"""Check a compose profile's GPU plan: which engine runs on which GPU, and whether they fit together.

    docker compose --profile gpu8 config | python docker/check_gpus.py --profile gpu8
    docker compose --profile gpu8-tp config | python docker/check_gpus.py --profile gpu8-tp
    docker compose --profile gpu config | python docker/check_gpus.py --profile gpu --scale decode=2

Reads the resolved file (``docker compose config``: anchors merged, variables substituted) and prints one
line per problem (exit 1), or the plan (exit 0). The rules, for the prefill and decode services of the
profile (``--scale`` counts a service's replicas, which share its reservation):

- a service on ``cuda`` reserves exactly one GPU per tensor-parallel rank (``EYRIE_TENSOR_PARALLEL``, default
  1), each by its id in ``device_ids`` (NVIDIA devices, no id twice): its ranks run on them, rank r on the r-th;
- a GPU that several engines share bounds each one: ``EYRIE_GPU_MEMORY_FRACTION`` (or ``EYRIE_NUM_PAGES``),
  else the first to start takes 0.9 of the GPU and the others only what it left; and the fractions on it
  sum to 1 at most (a split engine's fraction is its share of each of its GPUs);
- every engine of the profile agrees on what a hand-off carries (model, draft, dtype, page size, tree shape,
  device kind): any prefill instance may hand off to any decode instance. Tensor-parallel sizes may differ
  (a hand-off carries every KV head, and each side splits them its own way).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from dataclasses import dataclass

import yaml

ENGINE_ROLES = ("prefill", "decode")
HANDOFF_KEYS = ("EYRIE_MODEL", "EYRIE_DRAFT", "EYRIE_DTYPE", "EYRIE_PAGE_SIZE", "EYRIE_SPEC_TOPK", "EYRIE_SPEC_STEPS",
                "EYRIE_SPEC_DRAFT_TOKENS", "EYRIE_DEVICE")


@dataclass(frozen=True)
class Engine:
    """One prefill or decode service of a profile, as its GPU plan sees it."""

    name: str
    role: str  # prefill | decode
    env: dict  # EYRIE_* name -> value ("" = the default)
    gpus: tuple[str, ...]  # the device ids it reserves
    replicas: int


def _env(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(e.split("=", 1) if "=" in e else (e, None) for e in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def _gpus(service: dict) -> tuple[tuple[str, ...], list[str]]:
    """The device ids a service reserves, and what is wrong with its reservation."""
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices") or []
    ids, wrong = [], []
    for d in devices:
        if d.get("driver") != "nvidia" or "gpu" not in (d.get("capabilities") or []):
            wrong.append(f"a device that is not an NVIDIA GPU ({d})")
        if "count" in d:
            wrong.append(f"count: {d['count']} instead of device_ids (which GPU is left to chance)")
        ids += [str(i) for i in d.get("device_ids") or []]
    return tuple(ids), wrong


def engines(config: dict, profile: str, scale: dict[str, int]) -> list[Engine]:
    """The profile's prefill and decode services (those with no profile run in every profile)."""
    out = []
    for name, svc in sorted(config.get("services", {}).items()):
        cmd = svc.get("command") or []
        role = cmd[2] if isinstance(cmd, list) and cmd[:2] == ["eyrie", "serve"] and len(cmd) > 2 else None
        if role in ENGINE_ROLES and profile in svc.get("profiles", [profile]):
            out.append(Engine(name, role, _env(svc), _gpus(svc)[0], scale.get(name, 1)))
    return out


def problems(config: dict, profile: str, scale: dict[str, int] | None = None) -> list[str]:
    """Every rule the profile breaks, one sentence each (empty: the plan holds)."""
    scale = scale or {}
    found = engines(config, profile, scale)
    if not found:
        return [f"profile {profile}: no prefill or decode service"]
    out = []
    by_gpu: dict[str, list[Engine]] = defaultdict(list)
    for e in found:
        _, wrong = _gpus(config["services"][e.name])
        out += [f"{e.name}: {w}" for w in wrong]
        if not e.env.get("EYRIE_DEVICE", "").startswith("cuda"):
            if e.gpus:
                out.append(f"{e.name}: reserves GPU {', '.join(e.gpus)} but EYRIE_DEVICE is not cuda")
            continue
        wrong = _rank_gpus(e)
        out += [f"{e.name}: {w}" for w in wrong]
        if not wrong:
            for gpu in e.gpus:
                by_gpu[gpu].append(e)
    for gpu, sharing in sorted(by_gpu.items()):
        out += _shared_gpu(gpu, sharing)
    for role in ENGINE_ROLES:
        if not any(e.role == role for e in found):
            out.append(f"profile {profile}: no {role} service")
    first = found[0]
    for e in found[1:]:
        differ = [k for k in HANDOFF_KEYS if e.env.get(k, "") != first.env.get(k, "")]
        if differ:
            out.append(f"{e.name} and {first.name} disagree on {', '.join(differ)}: a hand-off between them is "
                       "refused")
    return out


def tensor_parallel(e: Engine) -> int | None:
    """The engine's ranks (``EYRIE_TENSOR_PARALLEL``, 1 when unset), or None when that is no positive integer."""
    text = e.env.get("EYRIE_TENSOR_PARALLEL", "").strip() or "1"
    return int(text) if text.isdigit() and int(text) > 0 else None


def _rank_gpus(e: Engine) -> list[str]:
    """What is wrong with a cuda engine's GPUs for its ranks: one GPU each, named once."""
    n = tensor_parallel(e)
    if n is None:
        return [f"EYRIE_TENSOR_PARALLEL={e.env['EYRIE_TENSOR_PARALLEL']!r} is not a positive integer"]
    twice = sorted({g for g in e.gpus if e.gpus.count(g) > 1})
    if twice:
        return [f"names GPU {', '.join(twice)} twice in device_ids (one GPU per tensor-parallel rank)"]
    if len(e.gpus) != n:
        return [f"reserves {len(e.gpus)} GPU{'' if len(e.gpus) == 1 else 's'} ({', '.join(e.gpus) or 'none'}) "
                f"but runs {n} tensor-parallel rank{'' if n == 1 else 's'} (EYRIE_TENSOR_PARALLEL): one GPU each"]
    return []


def _shared_gpu(gpu: str, sharing: list[Engine]) -> list[str]:
    """What is wrong with the engines on one GPU (each replica counts once)."""
    if sum(e.replicas for e in sharing) < 2:
        return []
    names = ", ".join(e.name + (f" x{e.replicas}" if e.replicas > 1 else "") for e in sharing)
    unbounded = [e.name for e in sharing if not e.env.get("EYRIE_GPU_MEMORY_FRACTION") and
                 not e.env.get("EYRIE_NUM_PAGES")]
    if unbounded:
        return [f"GPU {gpu} is shared by {names}, but {', '.join(unbounded)} set no EYRIE_GPU_MEMORY_FRACTION "
                "(the first to start takes 0.9 of the GPU)"]
    total = sum(float(e.env["EYRIE_GPU_MEMORY_FRACTION"]) * e.replicas for e in sharing
                if e.env.get("EYRIE_GPU_MEMORY_FRACTION"))
    if total > 1.0:
        return [f"GPU {gpu} is shared by {names}, whose memory fractions sum to {total:.2f} (> 1)"]
    return []


def plan(config: dict, profile: str, scale: dict[str, int] | None = None) -> str:
    """One line per engine: its GPUs, role, replicas, tensor-parallel size and memory fraction, in GPU order."""
    lines = []
    for e in sorted(engines(config, profile, scale or {}), key=lambda e: (e.gpus, e.name)):
        if not e.env.get("EYRIE_DEVICE", "").startswith("cuda"):
            lines.append(f"{e.env.get('EYRIE_DEVICE') or 'cpu'}: {e.name} ({e.role}) x{e.replicas}")
            continue
        fraction = e.env.get("EYRIE_GPU_MEMORY_FRACTION") or "0.9 (default)"
        split = f", tensor parallel {len(e.gpus)}" if len(e.gpus) > 1 else ""
        lines.append(f"GPU{'s' if len(e.gpus) > 1 else ''} {','.join(e.gpus)}: {e.name} ({e.role}) x{e.replicas}"
                     f"{split}, memory fraction {fraction}{' per GPU' if split else ''}")
    return "\n".join(lines)


def _scale(text: str) -> tuple[str, int]:
    name, _, n = text.partition("=")
    if not name or not n.isdigit():
        raise argparse.ArgumentTypeError(f"--scale takes SERVICE=N, got {text!r}")
    return name, int(n)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", required=True, help="the profile to check (gpu, gpu2, gpu8, gpu4-tp, gpu8-tp, ...)")
    p.add_argument("--scale", type=_scale, action="append", default=[], metavar="SERVICE=N",
                   help="replicas of a service, as docker compose up --scale gives them")
    p.add_argument("file", nargs="?", default="-", help="the resolved compose file (default: stdin)")
    args = p.parse_args(argv)
    text = sys.stdin.read() if args.file == "-" else open(args.file).read()
    config, scale = yaml.safe_load(text), dict(args.scale)
    found = problems(config, args.profile, scale)
    for line in found:
        print(line)
    if not found:
        print(plan(config, args.profile, scale))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
