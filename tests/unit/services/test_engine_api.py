"""The services reach the engine only through its narrow API, on the engine loop's thread.

Read from the source: no module of services/ touches an engine's internals (its scheduler, caches,
speculative worker, request table or models), and only the engine loop and the start-up code hold the
engine at all (every other module asks through ``EngineLoop.call`` or reads what the loop publishes).
No module of shared/spec/ or shared/handoff/ reaches back into the engine. Then, running: the loop
publishes the engine's load after every call, so a caller reads the state its own call left.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from services.engine_loop import EngineLoop
from shared.config import EngineConfig
from shared.engine import Engine
from shared.request import Request
from shared.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[3]
INTERNALS = {"scheduler", "cache", "caches", "speculator", "requests", "model", "decode_graphs", "tokenizer", "runner"}
HOLD_THE_ENGINE = {"services/engine_loop.py": "drives it on its thread",
                   "services/engine_service.py": "builds it, captures its graphs, hands it to the loop",
                   "services/followers.py": "under tensor parallelism: replays rank 0's calls on the other ranks"}


def _is_engine(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "engine") or (isinstance(node, ast.Attribute)
                                                                     and node.attr == "engine")


def boundary_violations(path: str, source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        if node.attr in INTERNALS and _is_engine(node.value):
            found.append(f"{path}:{node.lineno}: reads the engine's .{node.attr}")
        if node.attr == "engine" and path not in HOLD_THE_ENGINE:
            found.append(f"{path}:{node.lineno}: holds the engine (ask through the loop instead)")
    return found


def back_pointers(path: str, source: str) -> list[str]:
    """Imports of the engine (or of its worker, from the handoff code) and reads of an engine's scheduler."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        if any(n == "shared.engine" or n.startswith("shared.engine.") for n in names):
            found.append(f"{path}:{node.lineno}: imports the engine")
        if isinstance(node, ast.Attribute) and node.attr in ("scheduler", "engine"):
            found.append(f"{path}:{node.lineno}: reads .{node.attr}")
    return found


def files(*dirs: str) -> list[tuple[str, str]]:
    paths = sorted(p for d in dirs for p in (ROOT / d).rglob("*.py") if "_pb2" not in p.name)
    return [(p.relative_to(ROOT).as_posix(), p.read_text()) for p in paths]


def test_no_service_touches_engine_internals():
    found = [v for path, src in files("services") for v in boundary_violations(path, src)]
    assert not found, "services reaching into the engine:\n" + "\n".join(found)


def test_the_worker_and_the_handoff_code_do_not_reach_back_into_the_engine():
    found = [v for path, src in files("shared/spec", "shared/handoff") for v in back_pointers(path, src)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("line", ["engine.scheduler.running", "self.loop.engine.cache.num_free_pages",
                                  "engine.speculator.spec.topk", "engine.requests.get(rid)", "loop.engine.model"])
def test_the_boundary_checker_finds_each_reach(line):
    assert boundary_violations("services/decode/server.py", line)


def test_the_boundary_checker_allows_the_api_and_published_state():
    ok = "engine.release(req, 'abort')\nengine.page_sink(req, guard)\nload = self.loop.load\nself.loop.schema"
    assert not boundary_violations("services/decode/server.py", ok)
    assert back_pointers("shared/spec/worker.py", "from shared.engine import make_cache")
    assert back_pointers("shared/handoff/schema.py", "caches = engine.scheduler.caches")


def test_the_loop_publishes_the_load_each_call_leaves(tiny_model_dir):
    engine = Engine(tiny_model_dir / "target", config=EngineConfig(page_size=4, max_context=64, max_running=2),
                    role="decode")
    loop = EngineLoop(engine).start()
    try:
        empty = loop.load
        assert (empty.running, empty.queued) == (0, 0) and empty.free_pages == empty.total_pages
        params = SamplingParams(max_new_tokens=5)
        req = loop.call(lambda e: e.reserve_handoff("r", list(range(10)), [3], [0.0], params, 10)).result(5)
        held = loop.load  # read right after the call: the pages it reserved are already gone
        assert held.running == 1 and held.free_pages[0] == empty.free_pages[0] - 3  # 10 positions, pages of 4
        assert held.decode_tokens == 4  # max_new_tokens less the one token already out
        stranger = Request(rid="r", prompt_ids=[1], params=params)  # the same id, not the engine's request
        assert not loop.call(lambda e: e.release(stranger, "abort")).result(5) and loop.load == held
        assert loop.call(lambda e: e.release(req, "abort")).result(5)
        assert loop.load == empty and req.finish_reason == "abort"
    finally:
        loop.stop()
