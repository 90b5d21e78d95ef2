"""One owner per piece of request state, held by reading the source.

The scheduler (shared/scheduler.py) alone writes a request's ``stage`` and page ``handles`` and moves
requests between its table and queues; tokens, lengths, the draft state and the end of a request change
only through the request's own methods (shared/request.py). Any other module of shared/ or services/
that assigns one of these fields, mutates one of these lists, or edits the scheduler's table or queues
fails here, with the file and line. The checker is tested on sources that break each rule.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from shared.engine import Engine
from shared.request import Stage

ROOT = Path(__file__).resolve().parents[3]
SCHEDULER, REQUEST = "shared/scheduler.py", "shared/request.py"
OWNERS = {  # request field -> the one module that writes it
    "stage": SCHEDULER, "handles": SCHEDULER, "prefix_pages": SCHEDULER, "cached_tokens": SCHEDULER,
    "kv_len": REQUEST, "draft_state": REQUEST, "output_ids": REQUEST, "output_logprobs": REQUEST,
    "output_top_logprobs": REQUEST,
    "finish_reason": REQUEST, "t_first_token": REQUEST, "t_finish": REQUEST,
}
QUEUES = {"requests": SCHEDULER, "running": SCHEDULER, "waiting": SCHEDULER}  # the scheduler's table and queues
# Fields of the same name on objects that are not requests, each with what it is.
NOT_REQUESTS = {("shared/handoff/wire.py", "draft_state"): "the KVChunk protobuf message's bytes field",
                ("services/faults.py", "stage"): "a test hold gate's own stage to hold the loop at",
                ("services/router/server.py", "cached_tokens"): "the Finish protobuf message's usage field",
                ("services/router/choices.py", "cached_tokens"): "the Finish protobuf message's usage field"}
MUTATORS = {"append", "extend", "insert", "remove", "pop", "popleft", "appendleft", "clear", "update",
            "setdefault", "sort", "reverse", "__setitem__", "__delitem__"}


def _targets(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.Assign):
        out = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        out = [node.target]
    elif isinstance(node, ast.Delete):
        out = list(node.targets)
    else:
        return []
    flat = []
    while out:
        t = out.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            out += t.elts
        else:
            flat.append(t)
    return flat


def violations(path: str, source: str) -> list[str]:
    """Every write to request state, or to the scheduler's table and queues, that ``path`` may not make."""
    found = []

    def check(attr: str, owners: dict, node: ast.AST, what: str) -> None:
        if attr in owners and owners[attr] != path and (path, attr) not in NOT_REQUESTS:
            found.append(f"{path}:{node.lineno}: {what} .{attr} (only {owners[attr]} may)")

    for node in ast.walk(ast.parse(source)):
        for t in _targets(node):
            if isinstance(t, ast.Attribute):
                check(t.attr, OWNERS, node, "assigns")
            elif isinstance(t, ast.Subscript) and isinstance(t.value, ast.Attribute):
                check(t.value.attr, {**OWNERS, **QUEUES}, node, "writes an item of")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            inner = node.func.value
            if isinstance(inner, ast.Attribute):
                check(inner.attr, {**OWNERS, **QUEUES}, node, f"calls {node.func.attr} on")
    return found


def sources() -> list[tuple[str, str]]:
    files = sorted(p for d in ("shared", "services") for p in (ROOT / d).rglob("*.py"))
    return [(p.relative_to(ROOT).as_posix(), p.read_text()) for p in files]


def test_only_the_owners_write_request_state_and_the_request_table():
    found = [v for path, src in sources() for v in violations(path, src)]
    assert not found, "request state written outside its owner:\n" + "\n".join(found)


@pytest.mark.parametrize("line", [
    "req.kv_len = 3", "req.kv_len += 1", "r.stage = Stage.DECODING", "a, req.draft_state = 1, None",
    "req.finish_reason = 'error'", "req.output_ids.append(5)", "req.handles = []",
    "self.scheduler.running.append(req)", "engine.scheduler.waiting.popleft()", "self.requests[rid] = req",
    "del sched.requests[rid]",
])
def test_the_checker_finds_each_kind_of_write(line):
    assert violations("shared/engine.py", line) and violations("services/decode/server.py", line)


def test_the_checker_lets_the_owners_write_and_everyone_read():
    assert not violations(REQUEST, "self.kv_len = 3\nself.output_ids.append(4)")
    assert not violations(SCHEDULER, "req.stage = Stage.FINISHED\nreq.handles = []\nself.running.append(req)")
    assert not violations("shared/engine.py", "n = req.kv_len + len(req.output_ids)\nx = self.requests.get(rid)")


def test_one_registry_the_engine_reads_the_schedulers_table(tiny_model_dir):
    engine = Engine(tiny_model_dir / "target")
    req = engine.add_request([5, 6, 7], rid="a")
    assert engine.requests["a"] is req is engine.scheduler.get("a") and list(engine.requests) == ["a"]
    with pytest.raises(TypeError):
        engine.requests["b"] = req  # read-only: only the scheduler adds requests
    assert engine.abort("a") and req.stage is Stage.FINISHED and req.finish_reason == "abort"
    assert not engine.requests and not engine.scheduler.requests and not engine.abort("a")


def test_a_request_replaced_under_its_id_is_not_released_by_the_old_handle(tiny_model_dir):
    engine = Engine(tiny_model_dir / "target", role="decode")
    old = engine.reserve_handoff("r", [1, 2, 3], [4], [0.0], engine_params(), 3)
    assert engine.release(old, "abort") and not engine.release(old, "abort")
    new = engine.reserve_handoff("r", [1, 2, 3], [4], [0.0], engine_params(), 3)
    assert not engine.release(old, "abort") and not engine.activate_handoff(old, 3)
    assert engine.requests["r"] is new and new.stage is Stage.RECEIVING
    assert engine.activate_handoff(new, 3) and new.stage is Stage.DECODING and new.kv_len == 3
    assert not engine.activate_handoff(new, 3), "activated twice"
    assert engine.release(new, "abort") and engine.is_idle_and_clean()


def engine_params():
    from shared.sampling import SamplingParams

    return SamplingParams(max_new_tokens=2)
