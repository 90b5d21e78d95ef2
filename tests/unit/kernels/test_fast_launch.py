"""kernels/launch.py: the short launch path's keys are at least as fine as Triton's specialization (a key seen
before launches the compiled kernel it was stored with; anything that could change Triton's choice takes
``JITFunction.run``), and the launcher receives every parameter in the kernel's order with defaults filled.
The launches themselves run on the GPU (tests/gpu/test_fast_launch_gpu.py); here a real ``JITFunction`` is
built (never compiled) and its ``run`` and compiled kernel are recorded.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from triton.runtime.jit import JITFunction  # noqa: E402

import kernels.launch as launch  # noqa: E402


def _kernel(X, Y, n, stride, scale, BLOCK: tl.constexpr, EVEN: tl.constexpr = True):  # pragma: no cover
    """Its parameters only: ``JITFunction`` reads the signature here; the body is never compiled."""


class FakeCompiled:
    function = "function"
    packed_metadata = "metadata"

    def __init__(self):
        self.launches = []

    def run(self, *call):
        self.launches.append(call)


class Recorder:
    """A JIT function's params, with ``run`` (Triton's path) recorded and answering a fresh compiled kernel."""

    def __init__(self):
        self.params = JITFunction(_kernel).params
        self.slow = []

    def run(self, *args, grid, warmup, **kwargs):
        self.slow.append((grid, args, kwargs))
        return FakeCompiled()


@pytest.fixture
def launcher(monkeypatch):
    monkeypatch.setattr(launch, "current_device", lambda: 0)
    monkeypatch.setattr(launch, "current_stream", lambda device: 1234)
    rec = Recorder()
    return launch.Launcher(rec), rec


def test_int_keys_follow_tritons_specializations():
    keys = {v: launch.spec_key(v) for v in (1, 2, 16, 17, 32, -16, 2**31 - 16, 2**31, 2**63)}
    assert keys[16] == keys[32] == keys[-16] != keys[17]  # 16 divides it or not
    assert keys[1] != keys[17] and keys[2] == keys[17]  # 1 is a constant to Triton
    assert keys[2**31 - 16] == keys[16] != keys[2**31] != keys[2**63]  # i32 / i64 / u64


def test_tensor_keys_follow_dtype_and_alignment():
    a = torch.zeros(64, dtype=torch.float16)
    assert launch.spec_key(a) == launch.spec_key(torch.zeros(8, dtype=torch.float16))
    assert launch.spec_key(a) != launch.spec_key(a[1:])  # 2 bytes off 16-byte alignment
    assert launch.spec_key(a) == launch.spec_key(a[8:])  # 16 bytes on
    assert launch.spec_key(a) != launch.spec_key(a.float())
    assert launch.spec_key(torch.nn.Parameter(a)) == launch.spec_key(a)
    assert launch.spec_key(0.5) == launch.spec_key(2.0) and launch.spec_key(True) != launch.spec_key(False)
    with pytest.raises(launch.Unkeyable):
        launch.spec_key("a string")


def test_tensor_descriptor_keys_follow_dtype_and_block_shape():
    from triton.tools.tensor_descriptor import TensorDescriptor

    x = torch.zeros(64, 32, dtype=torch.float16)

    def desc(t, block):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block)

    assert launch.spec_key(desc(x, [16, 32])) == launch.spec_key(desc(torch.zeros(128, 32, dtype=torch.float16),
                                                                      [16, 32]))
    assert launch.spec_key(desc(x, [16, 32])) != launch.spec_key(desc(x, [32, 32]))
    assert launch.spec_key(desc(x, [16, 32])) != launch.spec_key(desc(x.float(), [16, 32]))


def test_call_shape_fills_defaults_in_order_and_names_missing_arguments():
    params = JITFunction(_kernel).params
    x, y = torch.zeros(4), torch.zeros(4)
    shape = launch.CallShape(params, 5, ("BLOCK", "num_warps"))
    assert shape.values((x, y, 3, 16, 0.5), {"BLOCK": 64, "num_warps": 4}) == [x, y, 3, 16, 0.5, 64, True]
    assert shape.keyword_const == (True, True) and shape.positional_const == (False,) * 5
    shape = launch.CallShape(params, 3, ("scale", "stride", "BLOCK", "EVEN"))
    assert shape.values((x, y, 3), {"scale": 0.5, "stride": 16, "BLOCK": 64, "EVEN": False}) == \
        [x, y, 3, 16, 0.5, 64, False]
    assert shape.keyword_const == (False, False, True, True)
    with pytest.raises(TypeError, match="BLOCK"):
        launch.CallShape(params, 5, ())


def test_a_seen_key_launches_the_stored_kernel_with_every_value(launcher):
    ln, rec = launcher
    x, y = torch.zeros(32), torch.zeros(32)
    first = ln[(4,)](x, y, 32, 16, 0.5, BLOCK=64)
    assert len(rec.slow) == 1 and first.launches == []  # Triton's own path compiled and launched it
    again = ln[(4, 2)](torch.zeros(8), torch.zeros(8), 48, 32, 2.0, BLOCK=64)
    assert again is first and len(rec.slow) == 1
    assert first.launches == [(4, 2, 1, 1234, "function", "metadata", None, None, None,
                              *first.launches[0][9:11], 48, 32, 2.0, 64, True)]


@pytest.mark.parametrize("change", ["n not a multiple of 16", "n is 1", "x misaligned", "dtype", "BLOCK",
                                    "num_warps", "keyword order", "device"])
def test_what_could_change_tritons_choice_takes_its_path(launcher, monkeypatch, change):
    ln, rec = launcher
    x, y = torch.zeros(32), torch.zeros(32)
    args, kwargs = [x, y, 32, 16, 0.5], {"BLOCK": 64, "num_warps": 4}
    ln[(1,)](*args, **kwargs)
    if change == "n not a multiple of 16":
        args[2] = 33
    elif change == "n is 1":
        args[2] = 1
    elif change == "x misaligned":
        args[0] = x[1:]
    elif change == "dtype":
        args[1] = y.half()
    elif change == "BLOCK":
        kwargs["BLOCK"] = 128
    elif change == "num_warps":
        kwargs["num_warps"] = 8
    elif change == "keyword order":
        kwargs = {"num_warps": 4, "BLOCK": 64}
    else:
        monkeypatch.setattr(launch, "current_device", lambda: 1)
    ln[(1,)](*args, **kwargs)
    assert len(rec.slow) == 2


def test_constexprs_python_calls_equal_are_apart(launcher):
    ln, rec = launcher
    x = torch.zeros(32)
    for block in (1, True, 1.0, 1):  # 1 == True == 1.0 in Python; three specializations to Triton
        ln[(1,)](x, x, 32, 16, 0.5, BLOCK=block)
    assert len(rec.slow) == 3


def test_unkeyable_arguments_callable_grids_and_hooks_always_take_tritons_path(launcher, monkeypatch):
    ln, rec = launcher
    x = torch.zeros(32)
    for _ in range(2):
        ln[(1,)](x, x, "not a number", 16, 0.5, BLOCK=64)
        ln[lambda meta: (1,)](x, x, 32, 16, 0.5, BLOCK=64)
        ln[(1,)](x, x, 32, 16, 0.5, BLOCK=[64])  # an unhashable constexpr
    assert len(rec.slow) == 6
    ln[(1,)](x, x, 32, 16, 0.5, BLOCK=64)
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda *a: None)
    ln[(1,)](x, x, 32, 16, 0.5, BLOCK=64)
    assert len(rec.slow) == 8


def test_fast_wraps_only_compiled_jit_functions():
    jit = JITFunction(_kernel)
    assert launch.fast(jit) is launch.fast(jit)
    assert isinstance(launch.fast(jit), launch.Launcher) == launch.ENABLED
    interpreted = object()
    assert launch.fast(interpreted) is interpreted
