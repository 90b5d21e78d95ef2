"""The stage timings of a ``gpu_house.sh`` run, read from its records, as lines for ``summary.txt``.

    python -m bench.house.summary OUT     # OUT holds house.json, head.json and measure.json

Each line names a stage of the device call and where its seconds went: the target's data preparation and
training, the head's phases (load, read, tokenize, vocab, windows, regenerate, train, eval, save), and
measure.py's stages, with what was skipped, so the next run's budgets can be planned from the last one's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def pairs(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items())


def lines(out: Path) -> list[str]:
    house, head, measure = read(out / "house.json"), read(out / "head.json"), read(out / "measure.json")
    rows = []
    if house:
        train = house.get("train", {})
        rows.append(f"target: prepare_s {house.get('prepare_seconds')}, train_s {train.get('seconds')} "
                    f"({train.get('steps')} steps), held-out perplexity {train.get('heldout_perplexity')}")
    if head:
        evals = head.get("evals") or [{}]
        rows.append(f"head: {pairs(head.get('phases', {}))} ({head.get('steps')} steps; "
                    f"{head.get('train_tokens')} training tokens of {head.get('train_docs')} documents sampled "
                    f"of {head.get('corpus_docs')}; final accept length {evals[-1].get('accept_length')})")
    if measure:
        rows.append(f"measure: {pairs(measure.get('stages', {}))}; skipped: {measure.get('skipped') or 'none'}")
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m bench.house.summary OUT", file=sys.stderr)
        return 2
    print("\n".join(lines(Path(argv[0]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
