"""Every engine step runs with the engine's GPU as the thread's current CUDA device.

Triton launches, CUDA events, streams and graph capture use the current device, not the device of the
tensors they touch; an engine on ``cuda:1`` stepped from the engine-loop thread (whose current device
is 0, as every new thread's is) would otherwise launch on GPU 0 and record the event that guards its
tokens' copy to the host on GPU 0's stream (the host would then read tokens before they arrive)."""

from __future__ import annotations

import contextlib

import torch

from shared.config import EngineConfig
from shared.engine import Engine
from shared.model_runner import ModelRunner
from shared.sampling import SamplingParams


def test_the_device_scope_names_the_engines_gpu():
    runner = ModelRunner.__new__(ModelRunner)  # the engine's scope is its runner's
    runner.device = torch.device("cuda", 1)
    scope = runner.on_device()
    assert isinstance(scope, torch.cuda.device) and scope.idx == 1
    runner.device = torch.device("cpu")
    assert isinstance(runner.on_device(), contextlib.nullcontext)


def test_every_step_runs_inside_the_device_scope(oracle_model_dir, monkeypatch):
    engine = Engine(oracle_model_dir / "target", oracle_model_dir / "eagle", EngineConfig(device="cpu"))
    depth, seen = [0], []

    @contextlib.contextmanager
    def scope():
        depth[0] += 1
        try:
            yield
        finally:
            depth[0] -= 1

    real_step = engine._step

    def step():
        seen.append(depth[0])
        return real_step()

    monkeypatch.setattr(engine, "on_device", scope)
    monkeypatch.setattr(engine, "_step", step)
    out = engine.generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert len(out[0].token_ids) == 6
    assert seen and all(d == 1 for d in seen)  # generate steps through step(), each inside the scope
