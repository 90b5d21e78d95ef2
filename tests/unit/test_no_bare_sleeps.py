"""No test waits for a state by sleeping a fixed time: a sleep long enough on this machine is too short on a
loaded one (the flakes of issue 35). A test polls the state with ``tests/polling.py`` (``poll``, ``wait_for``),
waits on an event, or holds the code at the state (a gate). A ``time.sleep`` is allowed only in a polling loop
(inside a ``while``, which re-checks its condition) or where the allow-list below names its function with the
reason the sleep is no wait for a state. Keep the list short.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# (path, qualified function) -> why its sleep is no wait for a state.
ALLOWED: dict[tuple[str, str], str] = {
    ("tests/unit/services/scripted_stack.py", "SteadyDecode.Stream"):
        "a scripted decode server's pace between tokens (interval_s), not a wait",
    ("tests/unit/handoff/test_handoff_wire.py", "_SlowSink.write"):
        "a slow receiver's pace: the sender must wait for it",
    ("tests/unit/services/test_router_redis_outage.py", "test_requests_streaming_through_a_redis_outage_lose_nothing"):
        "the outage's length (REDIS_OUTAGE_S) is the scenario; the streams' end is waited for by joining them",
    ("tests/unit/handoff/test_handoff_services.py",
     "test_the_prefill_frees_the_pages_only_after_the_decode_acknowledges"):
        "an observation window: the acknowledgement is held by an event, the pages must stay held across it",
}


def _is_sleep(call: ast.Call) -> bool:
    f = call.func
    return (isinstance(f, ast.Attribute) and f.attr == "sleep" and isinstance(f.value, ast.Name)
            and f.value.id == "time") or (isinstance(f, ast.Name) and f.id == "sleep")


def bare_sleeps(source: str) -> list[tuple[str, int]]:
    """(qualified function, line) of each ``time.sleep`` call of ``source`` not inside a ``while`` loop."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, name: str, in_while: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, f"{name}.{child.name}" if name else child.name, False)
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{name}.{child.name}" if name else child.name, in_while)
            else:
                if isinstance(child, ast.Call) and _is_sleep(child) and not in_while:
                    found.append((name or "<module>", child.lineno))
                visit(child, name, in_while or isinstance(child, ast.While))

    visit(ast.parse(source), "", False)
    return found


def test_bare_sleeps_are_found_and_polling_loops_are_not():
    source = '''
import time
def poller():
    while not done():
        time.sleep(0.01)
def waiter():
    start()
    time.sleep(0.5)
    assert done()
class Server:
    def pace(self):
        for _ in range(3):
            sleep(0.1)
'''
    assert bare_sleeps(source) == [("waiter", 8), ("Server.pace", 13)]


def test_no_bare_sleep_in_the_tests_outside_polling_helpers():
    found = {}
    for p in sorted((ROOT / "tests").rglob("*.py")):
        path = p.relative_to(ROOT).as_posix()
        if path in ("tests/polling.py", "tests/unit/test_no_bare_sleeps.py"):
            continue
        for name, line in bare_sleeps(p.read_text()):
            if (path, name) not in ALLOWED:
                found.setdefault(f"{path}::{name}", []).append(line)
    assert not found, ("time.sleep used to wait (poll with tests/polling.py, wait on an event or hold the code at "
                       f"the state; or add the function to ALLOWED with a reason): {found}")
    stale = [k for k in ALLOWED if not (ROOT / k[0]).exists()]
    assert not stale, f"ALLOWED names files that are gone: {stale}"
