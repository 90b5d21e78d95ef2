"""A tensor-parallel service's followers (services/followers.py) end with rank 0.

Rank 0 here is a process of its own that starts a TP-2 decode engine (its follower a process it started over
gloo) and is then killed with SIGKILL: it runs no clean-up, so the follower must notice by itself (its parent
is gone) and exit rather than wait forever in its pipe or a collective. And a Leader closed in the ordinary
way ends its follower with exit status 0; one whose follower died refuses the calls that need the group but
still frees its own pages.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.followers import start_engine
from services.settings import DecodeSettings
from shared.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[3]
RANK_0 = """
import sys, time
from services.followers import start_engine
from services.settings import DecodeSettings
leader = start_engine("decode", DecodeSettings(model=sys.argv[1], tensor_parallel=2, max_context=64, max_running=2))
print(*[p.pid for p in leader.ranks], flush=True)
time.sleep(600)
"""


def gone(pid: int) -> bool:
    """No such process, or a zombie (exited; nobody reaped it yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except (FileNotFoundError, ProcessLookupError):
        return True


def test_the_follower_exits_when_rank_0_is_killed(tiny_model_dir):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    rank0 = subprocess.Popen([sys.executable, "-c", RANK_0, str(tiny_model_dir / "target")], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, text=True)
    try:
        follower = int(rank0.stdout.readline())
        assert not gone(follower)
    finally:
        rank0.send_signal(signal.SIGKILL)
        rank0.wait(10)
    deadline = time.monotonic() + 15
    while not gone(follower) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(follower), "the follower outlived its rank 0"


def test_a_closed_leader_ends_its_follower_cleanly(tiny_model_dir):
    leader = start_engine("decode", DecodeSettings(model=str(tiny_model_dir / "target"), tensor_parallel=2,
                                                   max_context=64, max_running=2))
    try:
        assert leader.engine.runner.tp.size == 2 and leader.ranks[0].is_alive()
        params = SamplingParams(max_new_tokens=4)
        req = leader.reserve_handoff("r", [5, 6, 7], [8], [0.0], params, 3)  # replayed: both ranks reserve
        assert leader.holds(req) and leader.release(req, "abort") and not leader.release(req, "abort")
    finally:
        leader.close()
    assert [p.exitcode for p in leader.ranks] == [0]


def test_a_leader_whose_follower_died_refuses_calls_but_frees_its_own_pages(tiny_model_dir):
    leader = start_engine("decode", DecodeSettings(model=str(tiny_model_dir / "target"), tensor_parallel=2,
                                                   max_context=64, max_running=2))
    try:
        req = leader.reserve_handoff("r", [5, 6, 7], [8], [0.0], SamplingParams(max_new_tokens=4), 3)
        leader.ranks[0].kill()
        leader.ranks[0].join(10)
        with pytest.raises(RuntimeError, match="broken"):
            leader.step()
        assert leader.broken is not None
        assert leader.release(req, "abort") and leader.is_idle_and_clean()  # rank 0's pages back all the same
    finally:
        leader.close()
