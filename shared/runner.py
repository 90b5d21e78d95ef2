"""CUDA graphs for the decode phases, one graph per batch-size bucket.

A ``PhaseGraphs`` wraps one pure tensor function (target decode, draft loop, verify, or compaction +
draft extend). Its inputs and outputs are tensors or dataclasses of tensors whose first dimension
is the batch. Capture runs the function on padding inputs only (request row 0, whose slots are
the sink page), so capturing mutates no request's state. Replay copies the real rows into the static
inputs and resets the padding rows to their harmless values every time (stale padding rows gave
SGLang illegal memory accesses), then clones the outputs so the next replay cannot overwrite them.
A batch larger than the largest bucket, or a phase switched off, runs eagerly: same function.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch


def default_buckets(max_bs: int) -> list[int]:
    buckets = [b for b in (1, 2, 4, 8) if b <= max_bs]
    buckets += list(range(16, max_bs + 1, 8))
    return buckets


def tree_map(fn: Callable, obj: Any, *others: Any) -> Any:
    """Apply ``fn`` to every tensor leaf of (nested) dataclasses / tuples / lists."""
    if isinstance(obj, torch.Tensor):
        return fn(obj, *others)
    if dataclasses.is_dataclass(obj):
        return type(obj)(**{f.name: tree_map(fn, getattr(obj, f.name), *(getattr(o, f.name) for o in others))
                            for f in dataclasses.fields(obj)})
    if isinstance(obj, (tuple, list)):
        return type(obj)(tree_map(fn, x, *(o[i] for o in others)) for i, x in enumerate(obj))
    return obj


def pad_rows(x: torch.Tensor, bs: int, value: int | float = 0) -> torch.Tensor:
    """[n, ...] -> [bs, ...] with rows n.. set to ``value`` (padding: row 0, length 0, token 0)."""
    if x.dim() == 0 or x.shape[0] == bs:
        return x
    out = torch.full((bs, *x.shape[1:]), value, dtype=x.dtype, device=x.device)
    out[:x.shape[0]] = x
    return out


class PhaseGraphs:
    def __init__(self, name: str, fn: Callable, enabled: bool, max_bs: int):
        self.name = name
        self.fn = fn
        self.enabled = enabled  # pad to buckets (also on the CPU, where it exercises the padding path)
        self.capture = enabled and torch.cuda.is_available()
        self.buckets = default_buckets(max_bs)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple, Any]] = {}
        self._pool = None

    @property
    def captured_sizes(self) -> list[int]:
        """The bucket sizes captured so far."""
        return sorted(self._graphs)

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None) if self.enabled else None

    def __call__(self, *args):
        """``args`` already padded to a bucket size by the caller (see ``bucket``) or not at all."""
        bs = _batch_size(args)
        if not self.capture or bs not in self.buckets:
            return self.fn(*args)
        if bs not in self._graphs:
            self._graphs[bs] = self._capture(args)
        graph, static_args, static_out = self._graphs[bs]
        tree_map(lambda s, a: s.copy_(a), static_args, args)
        graph.replay()
        return tree_map(lambda t: t.clone(), static_out)

    def _capture(self, example: tuple):
        # Padding-only inputs: row 0 / length 0 / token 0 everywhere, masks all visible (no NaN rows).
        static_args = tree_map(lambda t: torch.ones_like(t) if t.dtype == torch.bool else torch.zeros_like(t), example)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up: Triton autotuning and allocator
                self.fn(*static_args)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            static_out = self.fn(*static_args)
        self._pool = graph.pool()
        return graph, static_args, static_out


def _batch_size(args: tuple) -> int:
    sizes = []
    tree_map(lambda t: sizes.append(t.shape[0]) if t.dim() else None, args)
    return sizes[0] if sizes else 0
