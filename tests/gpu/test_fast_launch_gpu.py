"""On CUDA: ``kernels.launch.fast`` launches a compiled kernel straight through its launcher only when Triton
would have chosen the same one. A row-strided view 2 bytes off 16-byte alignment, a width 16 does not divide,
a residual or none: each a specialization of its own, each right against the torch reference, and
the second pass over all of them never goes through ``JITFunction.run`` (tests/unit/kernels/test_fast_launch.py
holds the keys on the CPU). Also: inside a CUDA graph capture the short path records the launch on the
capturing stream (a replay with new inputs gives their result).
"""

from __future__ import annotations

import pytest
import torch

import kernels.fused as fused
import kernels.launch as launch
import kernels.norm_rope as norm_rope

pytestmark = pytest.mark.gpu


class Counting:
    """A JIT function's params and ``run``, counting the calls that take Triton's own path."""

    def __init__(self, fn):
        self.fn, self.params, self.calls = fn, fn.params, 0

    def run(self, *args, **kwargs):
        self.calls += 1
        return self.fn.run(*args, **kwargs)


@pytest.fixture
def counted(monkeypatch):
    out = {}
    for name, kernel in (("silu", fused._silu_mul_kernel), ("norm", norm_rope._rms_norm_kernel)):
        launcher = launch.fast(kernel)
        assert isinstance(launcher, launch.Launcher), "EYRIE_FAST_LAUNCH=0 or the interpreter is on"
        monkeypatch.setattr(launcher, "fn", Counting(kernel))
        monkeypatch.setattr(launcher, "kernels", {})
        out[name] = launcher.fn
    return out


def _cases(dev):
    g = torch.Generator(device=dev).manual_seed(0)
    buf = torch.randn(64, 2 * 1024 + 8, generator=g, device=dev, dtype=torch.bfloat16)
    yield "silu aligned", lambda: fused.silu_mul(buf[:, :2048]), lambda: fused.silu_mul_ref(buf[:, :2048])
    yield "silu 2 bytes off", lambda: fused.silu_mul(buf[:, 1:2049]), lambda: fused.silu_mul_ref(buf[:, 1:2049])
    yield "silu width 1000", lambda: fused.silu_mul(buf[:, :2000]), lambda: fused.silu_mul_ref(buf[:, :2000])
    yield "silu one row", lambda: fused.silu_mul(buf[:1, 1:2049]), lambda: fused.silu_mul_ref(buf[:1, 1:2049])
    x = torch.randn(17, 4096, generator=g, device=dev, dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = torch.randn(4096, generator=g, device=dev, dtype=torch.bfloat16)
    yield "norm", lambda: norm_rope.rms_norm(x, w, 1e-5), lambda: norm_rope.rms_norm_ref(x, w, 1e-5)
    yield "norm residual", lambda: norm_rope.rms_norm(x, w, 1e-5, r), lambda: norm_rope.rms_norm_ref(x, w, 1e-5, r)
    yield "norm width 1000", (lambda: norm_rope.rms_norm(x[:, :1000], w[:1000], 1e-5),
                              lambda: norm_rope.rms_norm_ref(x[:, :1000], w[:1000], 1e-5))


def _flat(out):
    return torch.cat([t.float().flatten() for t in out]) if isinstance(out, tuple) else out.float().flatten()


def test_each_specialization_is_right_and_a_second_pass_skips_the_jit(counted):
    dev = torch.device("cuda")
    cases = list(_cases(dev))
    for _ in range(2):
        for name, run, ref in cases:
            got, want = _flat(run()), _flat(ref())
            torch.cuda.synchronize()
            assert torch.allclose(got, want, atol=2e-2, rtol=2e-2), name
        if _ == 0:
            first = {k: c.calls for k, c in counted.items()}
    assert first == {"silu": 3, "norm": 3}  # one row: the offset view's key (only the grid differs)
    assert {k: c.calls for k, c in counted.items()} == first


def test_a_captured_short_launch_replays_on_new_inputs(counted):
    dev = torch.device("cuda")
    gate_up = torch.randn(8, 2048, device=dev, dtype=torch.bfloat16)
    fused.silu_mul(gate_up)  # compiled and stored: the capture below takes the short path
    calls = counted["silu"].calls
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused.silu_mul(gate_up)
    assert counted["silu"].calls == calls
    gate_up.copy_(torch.randn_like(gate_up))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.allclose(out.float(), fused.silu_mul_ref(gate_up).float(), atol=2e-2, rtol=2e-2)
