"""Top functions of a py-spy raw (collapsed) profile, per thread: self time and inclusive time.

Usage: ``python bench/pyspy_top.py out/pyspy-decode.txt [--top 25]``
"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    per_thread: dict[str, Counter] = defaultdict(Counter)
    inclusive: dict[str, Counter] = defaultdict(Counter)
    totals: Counter = Counter()
    for line in open(args.path, errors="replace"):
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        thread, frames = frames[0], frames[1:]
        n = int(count)
        totals[thread] += n
        if frames:
            per_thread[thread][frames[-1]] += n
        for f in set(frames):
            inclusive[thread][f] += n
    for thread, total in totals.most_common():
        print(f"== {thread}: {total} samples")
        print("  self:")
        for f, n in per_thread[thread].most_common(args.top):
            print(f"    {n / total:6.1%}  {f}")
        print("  inclusive:")
        for f, n in inclusive[thread].most_common(args.top):
            print(f"    {n / total:6.1%}  {f}")


if __name__ == "__main__":
    main()
