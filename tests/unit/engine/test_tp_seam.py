"""Tensor parallelism has one seam: the model runner (``shared/model_runner.py``) with ``shared/parallel.py``.

Read from the source: no module of shared/ or services/ reads a tensor-parallel group's members (``tp.`` or
``self.tp``) unless it is the runner, the group itself, the split model it runs (its layers all-reduce) or the
rank processes a service starts. The engine, the scheduler, the speculator, the hand-off port and the replay
(``shared/replay.py``) see the runner (``send``, ``receive``, ``leading``; the port its gathers and scatters of
every KV head), never the group.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SEAM = {"shared/model_runner.py": "the seam", "shared/parallel.py": "the group and its collectives",
        "services/followers.py": "the rank processes a split service starts"}
MODEL = "shared/model/"  # the split target's layers hold the group for their all-reduces


def group_reads(source: str) -> list[int]:
    """Lines that read a group's member (``tp.x``, ``self.tp``, ``obj.tp.x``)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        v = node.value
        if (isinstance(v, ast.Name) and v.id == "tp") or (isinstance(v, ast.Attribute) and v.attr == "tp"):
            lines.append(node.lineno)
        elif node.attr == "tp" and isinstance(v, ast.Name) and v.id == "self":
            lines.append(node.lineno)
    return lines


def test_only_the_runner_and_the_group_read_the_tensor_parallel_group():
    found = []
    for d in ("shared", "services"):
        for p in sorted((ROOT / d).rglob("*.py")):
            path = p.relative_to(ROOT).as_posix()
            if path in SEAM or path.startswith(MODEL) or "_pb2" in path:
                continue
            found += [f"{path}:{n}" for n in group_reads(p.read_text())]
    assert not found, "tensor parallelism outside its seam (ask the model runner):\n" + "\n".join(found)


def test_the_checker_finds_each_read():
    assert group_reads("if self.tp is not None:\n    x = 1") == [1]
    assert group_reads("r = tp.rank") == [1]
    assert group_reads("n = engine.runner.tp.size") == [1]
    assert group_reads("port = Port(runner.tp)\ndef f(tp):\n    return g(tp)") == []
