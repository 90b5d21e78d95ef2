"""Triton launches without the JIT's per-call work: ``fast(kernel)[grid](*args, **kwargs)``.

``JITFunction.run`` binds every argument, specializes each one in C, builds a cache key from them and
the compile options, looks the kernel up, reads a dozen knobs and only then calls the compiled
launcher. On an H100 host that is ~75 us a launch under cProfile and ~200 launches in an eager mixed
step at 128 streams (docs/benchmarks.md, 2026-12-08): the step waited on its host, not on the GPU.

``fast(kernel)`` keeps, per call shape, the compiled kernels it has seen under a key that is at least as
fine as Triton's own: a constexpr by value; a tensor by dtype and whether its address is 16-byte aligned;
an int by whether it is 1, whether 16 divides it and which of i32 / i64 / u64 holds it; a tensor
descriptor by its base's dtype and alignment, block shape and strides' alignment; a float or None by
type; a compile option (``num_warps``...) by value. Equal keys therefore mean Triton would pick the same
compiled kernel, which is launched straight through its launcher. A key not seen yet, an argument of
another kind, a callable grid or a launch hook (a profiler's) goes through ``JITFunction.run`` as before.
Under ``TRITON_INTERPRET=1`` (CPU, CI) ``fast`` returns the kernel itself. ``EYRIE_FAST_LAUNCH=0`` turns
the short path off (read once, at import).
"""

from __future__ import annotations

import inspect
import os

import torch

try:
    from triton import knobs
    from triton.runtime.jit import JITFunction
except ImportError:  # pragma: no cover
    JITFunction = None

ENABLED = os.environ.get("EYRIE_FAST_LAUNCH", "1") != "0"
current_device = torch._C._cuda_getDevice if hasattr(torch._C, "_cuda_getDevice") else (lambda: 0)
current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0)

_I32 = 1 << 31
_I64 = 1 << 63


def _hooked(hook) -> bool:
    """A launch hook is set (a profiler's): None or an empty ``HookChain`` (Triton 3.6, 3.9) is none."""
    return hook is not None and bool(getattr(hook, "calls", True))


class Unkeyable(Exception):
    """An argument whose specialization this module does not model: the launch takes Triton's own path."""


def spec_key(v):
    """A key for one runtime argument at least as fine as Triton's specialization of it."""
    t = type(v)
    if t is int:
        return (v == 1, v & 15 == 0, -_I32 <= v < _I32, v < _I64)
    if isinstance(v, torch.Tensor):
        return (v.dtype, v.data_ptr() & 15 == 0)
    if t is float:
        return float
    if t is bool:
        return (bool, v)
    if v is None:
        return None
    block_shape = getattr(v, "block_shape", None)
    base = getattr(v, "base", None)
    if block_shape is not None and isinstance(base, torch.Tensor):  # a host-side TensorDescriptor
        return (t, base.dtype, base.data_ptr() & 15 == 0, tuple(block_shape),
                tuple(s & 15 == 0 for s in v.strides), getattr(v, "padding", None))
    raise Unkeyable(t.__name__)


class CallShape:
    """How one call site's arguments (``n`` positional, these keyword names) map onto the kernel's parameters."""

    __slots__ = ("positional_const", "keyword_const", "tail")

    def __init__(self, params: list, n: int, names: tuple[str, ...]):
        if n > len(params):
            raise TypeError(f"{n} positional arguments for {len(params)} parameters")
        by_name = {p.name: p for p in params}
        self.positional_const = tuple(p.is_constexpr for p in params[:n])
        # a keyword that names no parameter is a compile option (num_warps, num_stages...): keyed by value
        self.keyword_const = tuple(name not in by_name or by_name[name].is_constexpr for name in names)
        self.tail = []  # the parameters after the positional ones: (name, given as keyword, default)
        for p in params[n:]:
            default = p.default
            if p.name not in names and default is inspect.Parameter.empty:
                raise TypeError(f"missing argument {p.name!r}")
            self.tail.append((p.name, p.name in names, default))

    def key(self, args: tuple, kwargs: dict) -> tuple:
        key = []
        # a constexpr by type and value: True == 1 == 1.0 in Python, not to Triton
        for v, const in zip(args, self.positional_const):
            key.append((v.__class__, v) if const else spec_key(v))
        for v, const in zip(kwargs.values(), self.keyword_const):
            key.append((v.__class__, v) if const else spec_key(v))
        return tuple(key)

    def values(self, args: tuple, kwargs: dict) -> list:
        """Every parameter's value in the kernel's order, defaults filled: what the compiled launcher takes."""
        vals = list(args)
        for name, given, default in self.tail:
            vals.append(kwargs[name] if given else default)
        return vals


class Launcher:
    """One JIT kernel's short launch path; ``launcher[grid](*args, **kwargs)`` as ``kernel[grid](...)``."""

    def __init__(self, fn):
        self.fn = fn
        self.params = list(fn.params)
        self.shapes: dict[tuple, CallShape] = {}
        self.kernels: dict[tuple, object] = {}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args: tuple, kwargs: dict):
        if callable(grid) or _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook):
            return self.fn.run(*args, grid=grid, warmup=False, **kwargs)
        names = tuple(kwargs)
        shape = self.shapes.get((len(args), names))
        if shape is None:
            shape = self.shapes[(len(args), names)] = CallShape(self.params, len(args), names)
        device = current_device()
        try:
            key = (len(args), names, device) + shape.key(args, kwargs)
            kernel = self.kernels.get(key)
        except (Unkeyable, TypeError):  # TypeError: an unhashable constexpr
            return self.fn.run(*args, grid=grid, warmup=False, **kwargs)
        if kernel is None:
            kernel = self.fn.run(*args, grid=grid, warmup=False, **kwargs)
            if kernel is not None:
                self.kernels[key] = kernel
            return kernel
        n = len(grid)
        kernel.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1,
                   current_stream(device), kernel.function, kernel.packed_metadata, None,
                   None, None, *shape.values(args, kwargs))
        return kernel


_LAUNCHERS: dict[int, object] = {}


def fast(fn):
    """``fn``'s launcher: a ``Launcher`` for a compiled JIT kernel, ``fn`` itself otherwise (the interpreter)."""
    launcher = _LAUNCHERS.get(id(fn))
    if launcher is None:
        use = ENABLED and JITFunction is not None and isinstance(fn, JITFunction)
        launcher = _LAUNCHERS[id(fn)] = (Launcher(fn) if use else fn)
    return launcher


__all__ = ["ENABLED", "CallShape", "Launcher", "Unkeyable", "fast", "spec_key"]
