"""Print two ``bench_decode.py`` JSONs side by side (before / after): the decode step per batch and context, the
verify step per draft-token count, and the speculative iteration's phases, graph times, with the ratio.

    python bench/baseline/compare_decode.py before.json after.json
"""

from __future__ import annotations

import json
import sys


def rows(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def line(name: str, a: float | None, b: float | None) -> str:
    if a is None or b is None:
        return f"{name:34s} {a!s:>10s} {b!s:>10s}"
    return f"{name:34s} {a:10.3f} {b:10.3f}   x{b / a:.3f}"


def main(before: str, after: str) -> None:
    a, b = rows(before), rows(after)
    print(f"device: {b.get('device')}   (ms, graph)          before      after   after/before")
    dec_a = {(r["batch"], r["context"]): r.get("graph_ms") for r in a.get("decode", [])}
    for r in b.get("decode", []):
        key = (r["batch"], r["context"])
        print(line(f"decode bs={key[0]} ctx={key[1]}", dec_a.get(key), r.get("graph_ms")))
    ver_a = {r["num_draft_tokens"]: r["graph_ms"] for r in a.get("verify", [])}
    for r in b.get("verify", []):
        print(line(f"verify N={r['num_draft_tokens']} ctx=1024", ver_a.get(r["num_draft_tokens"]), r["graph_ms"]))
    spec_a, spec_b = (a.get("spec") or [{}])[0], (b.get("spec") or [{}])[0]
    for k in sorted(spec_b):
        if k.endswith("graph_ms"):
            print(line(f"spec {k}", spec_a.get(k), spec_b[k]))


if __name__ == "__main__":
    main(*sys.argv[1:3])
