"""On CUDA: the draft's work inside a step never makes the host wait for the device. Its extend over a step's
prefill chunks (queued before the host waits for the step's tokens), a backlog's catch-up and the backlog's puts
are queued behind the target's forward; a wait inside them (a host index into a device tensor, a pageable copy, a
read back) stops the host launching until the device drains, and an eager step then costs its kernels plus the
launches after the wait (issue 31: ~2 ms of a mixed step's 22 at c128, H100). Run under
``torch.cuda.set_sync_debug_mode("error")``: any synchronizing call raises.
``bench/find_syncs.py`` lists every wait of a whole loop by site."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from shared.config import EngineConfig
from shared.engine import Engine
from shared.sampling import SamplingParams
from shared.spec.worker import SpecWorker

pytestmark = pytest.mark.gpu

PAIR = Path(__file__).resolve().parents[2] / "models" / "tiny-pair"
WATCHED = ("launch_rows", "launch_extend", "catch_up", "leave_behind")


@pytest.fixture
def no_waits(monkeypatch):
    calls = dict.fromkeys(WATCHED, 0)
    for name in WATCHED:
        fn = getattr(SpecWorker, name)

        @functools.wraps(fn)
        def strict(*a, _fn=fn, _name=name, **k):
            calls[_name] += 1
            torch.cuda.set_sync_debug_mode("error")
            try:
                return _fn(*a, **k)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        monkeypatch.setattr(SpecWorker, name, strict)
    return calls


def test_the_drafts_work_in_a_step_never_waits_for_the_device(no_waits):
    config = EngineConfig(device="cuda", dtype="bfloat16", chunk_size=64, max_running=16, spec_policy="adaptive",
                          spec_draft_backlog=4, cuda_graph=True)
    engine = Engine(str(PAIR / "target"), str(PAIR / "eagle3"), config)
    engine.capture_graphs()
    reqs = [engine.add_request([5 + (i * 13 + j) % 1900 for j in range(40 + 30 * i)],
                               SamplingParams(max_new_tokens=48, ignore_eos=True)) for i in range(6)]
    for step in range(400):
        if step == 20:  # prompts arriving while the others decode: mixed steps, chunks the draft extends over
            reqs += [engine.add_request([7 + j % 1500 for j in range(150)],
                                        SamplingParams(max_new_tokens=24, ignore_eos=True)) for _ in range(3)]
        engine.step()
        if all(r.finish_reason is not None for r in reqs):
            break
    assert all(r.finish_reason == "length" for r in reqs)
    assert no_waits["launch_rows"] > 0  # the prompts' chunks: the extend queued before the step's host wait
    assert no_waits["launch_extend"] > no_waits["launch_rows"]  # and the catch-ups' extends
