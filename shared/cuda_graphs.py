"""CUDA graphs for the decode phases, one graph per batch-size bucket.

A ``PhaseGraphs`` wraps one pure tensor function (target decode, draft loop, verify, or compaction +
draft extend). Its inputs and outputs are tensors or dataclasses of tensors whose first dimension
is the batch. Capture runs the function on padding inputs only (request row 0, whose slots are
the sink page), so capturing mutates no request's state. Replay copies the real rows into the static
inputs and resets the padding rows to their harmless values every time (stale padding rows gave
SGLang illegal memory accesses), then clones the outputs so the next replay cannot overwrite them.
Every batch size of a phase writes its outputs into one buffer of the phase (``SharedOutputs``, rows for
the largest bucket): a graph's own outputs are freed at the end of its capture and their memory goes back
to the pool, so a phase keeps one set of outputs, not one per batch size (an adaptive engine's verify
logits over 15 batch sizes and 5 shapes were most of its graphs' memory).
A batch larger than the largest bucket, or a phase switched off, runs eagerly: same function.

Capture is made safe and contained (a failed capture once poisoned a whole process):
- every kernel specialization is launched eagerly on the capture stream before capture begins, then
  the device is synchronized, so nothing else is in flight and no kernel is compiled or loaded inside;
- the cyclic garbage collector is paused while capturing (a collection could free a dead engine's
  graphs or tensors mid-capture), and capture runs in ``thread_local`` mode, so another thread's CUDA
  calls (a service's gRPC or hand-off threads) cannot invalidate it;
- if capture fails anyway, the phase falls back to eager execution for good (same function, so the same
  tokens), the failure is logged and recorded (``failures``: served in ``/health`` and counted in
  ``eyrie_graph_capture_failures``), and the CUDA generator, which a failed capture leaves in capture
  mode, is released and restored; if it cannot be, ``CudaStatePoisoned`` is raised rather than serving on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import time
from collections.abc import Iterable, Iterator
from typing import Any, Callable

import torch
from tqdm import tqdm

log = logging.getLogger("eyrie.graphs")


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


@dataclasses.dataclass(frozen=True)
class CaptureFailure:
    """A graph that could not be captured: its phase then runs eagerly."""

    phase: str
    batch_size: int
    reason: str

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class CudaStatePoisoned(RuntimeError):
    """A failed capture left the CUDA generator unusable: the process must not serve on."""


class GraphPool:
    """The memory pool every CUDA graph of one engine captures into. A step replays one graph at a time, on one
    stream, and copies its outputs out before the next replays, so a graph's intermediates may live where
    another's did: the engine's graphs need about the largest one's memory, not the sum over phases, shapes
    and batch sizes (an adaptive engine's 5 shapes x 4 phases at 128 rows ran a GPU out of memory with a pool
    each). vLLM and SGLang share one pool the same way."""

    def __init__(self):
        self.handle = None  # the first capture's pool, then every later capture's


class CaptureBudget:
    """Whether the next batch size's graphs fit the engine's memory budget (its ``gpu_memory_fraction`` of the
    device): what the allocator holds now (graph pools, capture warm-ups and pools included), plus the last
    batch size's growth scaled to the next one's rows, plus ``outside`` (the process's memory outside PyTorch).
    Asked before each batch size, in increasing order; the first always fits."""

    def __init__(self, device: torch.device, budget: int, outside: int = 0):
        self.device, self.budget, self.outside = device, budget, outside
        self._last: tuple[int, int] | None = None  # (batch size, the allocator's reservation before it)
        self.stopped_at: int | None = None  # the first batch size that did not fit

    def __call__(self, bs: int) -> bool:
        now = torch.cuda.memory_reserved(self.device)
        if self._last is None:
            self._last = (bs, now)
            return True
        last_bs, before = self._last
        self._last = (bs, now)
        if now + max(0, now - before) * bs / last_bs + self.outside <= self.budget:
            return True
        self.stopped_at = bs
        return False


class SharedOutputs:
    """One phase's outputs for every batch size: per output tensor whose first dimension grows with the batch
    (``rows_per_request`` x bs), a buffer for the largest bucket, allocated outside the graph pool before the
    first capture; a graph copies its outputs into the buffer's first rows (inside the graph) and replays
    return those rows. Outputs that do not scale with the batch stay the graph's own."""

    def __init__(self):
        self.buffers: list[torch.Tensor | None] | None = None  # per output leaf, in ``tree_map`` order

    def allocate(self, example_out: Any, bs: int, max_bs: int) -> None:
        """Size the buffers from a warm-up's outputs at batch size ``bs`` (once: the first capture's)."""
        if self.buffers is not None:
            return
        leaves: list[torch.Tensor] = []
        tree_map(leaves.append, example_out)
        self.buffers = [torch.empty((t.shape[0] // bs * max_bs, *t.shape[1:]), dtype=t.dtype, device=t.device)
                        if t.dim() and t.shape[0] and t.shape[0] % bs == 0 else None for t in leaves]

    def bind(self, out: Any) -> Any:
        """Inside a capture: ``out`` copied into the buffers' first rows; the views the graph's replays return
        (a leaf the buffers cannot hold, by shape or dtype, stays the graph's own)."""
        index = iter(range(len(self.buffers or ())))

        def one(t: torch.Tensor) -> torch.Tensor:
            i = next(index, None)
            buf = None if i is None or self.buffers is None else self.buffers[i]
            if (buf is None or not t.dim() or t.shape[1:] != buf.shape[1:] or t.dtype != buf.dtype
                    or t.shape[0] > buf.shape[0]):
                return t
            view = buf[:t.shape[0]]
            view.copy_(t)
            return view

        return tree_map(one, out)


class PhaseGraphs:
    def __init__(self, name: str, fn: Callable, enabled: bool, max_bs: int,
                 failures: list[CaptureFailure] | None = None, before_replay: Callable[[], None] | None = None,
                 pool: GraphPool | None = None):
        self.name = name
        self.fn = fn
        self.before_replay = before_replay  # runs before each replay (state the graph reads, made current)
        self.enabled = enabled  # pad to buckets (also on the CPU, where it exercises the padding path)
        self.capture = enabled and torch.cuda.is_available()
        self.buckets = default_buckets(max_bs)
        self.outputs = SharedOutputs()  # every batch size's outputs, in one buffer
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple, Any]] = {}
        self.pool = GraphPool() if pool is None else pool  # the engine's, shared by its phases
        # Capture failures, shared by every phase of an engine (the engine's list when given).
        self.failures: list[CaptureFailure] = [] if failures is None else failures
        self.progress: tqdm | None = None  # ticked once per capture, while ``capture_progress`` holds it
        self.capture_s = 0.0  # seconds spent capturing this phase's graphs, their warm-up runs included

    @property
    def captured_sizes(self) -> list[int]:
        """The bucket sizes captured so far."""
        return sorted(self._graphs)

    def stop_at(self, bs: int) -> None:
        """Capture and replay only batch sizes below ``bs`` from now on (larger batches run eagerly, unpadded):
        the sizes the engine's memory fraction had room for."""
        self.buckets = [b for b in self.buckets if b < bs]
        for b in [b for b in self._graphs if b >= bs]:
            del self._graphs[b]

    def release(self) -> None:
        """Drop every captured graph (this phase runs eagerly from now on): before a tensor-parallel group is
        destroyed, since NCCL's destroy hangs while a graph holding its collectives lives (pytorch#115388)."""
        for graph, _, _ in self._graphs.values():
            graph.reset()
        self._graphs.clear()
        self.capture = False

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None) if self.enabled else None

    def __call__(self, *args):
        """``args`` already padded to a bucket size by the caller (see ``bucket``) or not at all."""
        bs = _batch_size(args)
        if not self.capture or bs not in self.buckets:
            return self.fn(*args)
        if self.before_replay is not None:
            self.before_replay()  # e.g. the request-to-token tables' pending writes: the graph reads the device's
        if bs not in self._graphs:
            captured = self._capture(args)
            if captured is None:  # this phase runs eagerly from now on (padded inputs, same function)
                return self.fn(*args)
            self._graphs[bs] = captured
        graph, static_args, static_out = self._graphs[bs]
        tree_map(lambda s, a: s.copy_(a), static_args, args)
        graph.replay()
        return tree_map(lambda t: t.clone(), static_out)

    def _capture(self, example: tuple):
        """The graph of ``fn`` at ``example``'s batch size, or None when capture failed (recorded)."""
        t0 = time.perf_counter()
        try:
            return self._capture_at(example)
        finally:
            self.capture_s += time.perf_counter() - t0

    def _capture_at(self, example: tuple):
        # Padding-only inputs: row 0 / length 0 / token 0 everywhere, masks all visible (no NaN rows).
        static_args = tree_map(lambda t: torch.ones_like(t) if t.dtype == torch.bool else torch.zeros_like(t), example)
        stream = capture_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # every kernel compiled, loaded and autotuned before capture, on its stream
                warm = self.fn(*static_args)
        self.outputs.allocate(warm, _batch_size(example), max(self.buckets))
        del warm
        torch.cuda.synchronize()  # nothing else in flight when capture begins
        rng = torch.cuda.get_rng_state()
        gc.collect()
        try:
            with collector_paused():
                graph, static_out = record_graph(lambda: self.outputs.bind(self.fn(*static_args)), stream, self.pool)
        except Exception as e:  # noqa: BLE001 (any failure inside capture is contained the same way)
            self._contain(e, _batch_size(example), rng)
            self._tick()
            return None
        self._tick()
        return graph, static_args, static_out

    def _tick(self) -> None:
        if self.progress is not None:
            self.progress.update(1)

    def _contain(self, error: BaseException, batch_size: int, rng: torch.Tensor) -> None:
        """After a failed capture: this phase goes eager (``contain_failure`` records it)."""
        self.capture = False
        contain_failure(self.failures, self.name, batch_size, error, rng)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic collection (freeing dead graphs or tensors) in the middle of a capture."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def record_graph(fn: Callable[[], Any], stream: torch.cuda.Stream, pool: GraphPool) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Capture one run of ``fn()`` on ``stream`` into ``pool`` (``thread_local`` mode: another thread's CUDA calls
    cannot invalidate it); the pool's handle is the first capture's. Returns the graph and ``fn``'s result;
    raises whatever went wrong, after ending the capture."""
    graph = torch.cuda.CUDAGraph()
    error: BaseException | None = None
    out = None
    with torch.cuda.stream(stream):
        graph.capture_begin(*((pool.handle,) if pool.handle is not None else ()), capture_error_mode="thread_local")
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001 (the capture must still be ended)
            error = e
        try:
            graph.capture_end()
        except Exception as e:  # noqa: BLE001
            error = error or e
    if error is not None:
        raise error
    if pool.handle is None:
        pool.handle = graph.pool()
    return graph, out


def contain_failure(failures: list[CaptureFailure], phase: str, size: int, error: BaseException,
                    rng: torch.Tensor) -> None:
    """After a failed capture (its phase then runs eagerly): the failure recorded and logged, the CUDA generator
    released from capture mode and its state restored."""
    reason = f"{type(error).__name__}: {error}".splitlines()[0][:500]
    failures.append(CaptureFailure(phase, size, reason))
    log.warning("CUDA graph capture of phase %s at size %d failed; the phase runs eagerly: %s", phase, size, reason)
    restore_cuda_rng(rng)


@contextlib.contextmanager
def capture_progress(graphs: Iterable[PhaseGraphs], desc: str = "capturing CUDA graphs") -> Iterator[tqdm]:
    """A progress bar on stderr (off when it is not a terminal) over the captures of ``graphs`` made inside
    the block: one step per phase and batch-size bucket to capture."""
    graphs = [g for g in graphs if g.capture]
    with tqdm(total=sum(len(g.buckets) for g in graphs), unit="graph", desc=desc, leave=False, disable=None) as bar:
        for g in graphs:
            g.progress = bar
        try:
            yield bar
        finally:
            for g in graphs:
                g.progress = None


def capture_stream() -> torch.cuda.Stream:
    """The current device's capture stream: one per device, used for nothing else."""
    dev = torch.cuda.current_device()
    if dev not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[dev] = torch.cuda.Stream()
    return _CAPTURE_STREAMS[dev]


_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def restore_cuda_rng(state: torch.Tensor) -> None:
    """Release the current device's default CUDA generator from capture mode and set ``state``.

    A capture whose end failed never ran the generator's capture epilogue, so the generator still
    believes it is capturing and every later random op fails ("Offset increment outside graph capture").
    A capture that succeeds runs the epilogue: one tiny capture clears the flag; the generator's eager
    seed and offset are then set back to what they were before the failed capture."""
    try:
        torch.cuda.synchronize()
        scratch = torch.zeros(1, device="cuda")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(capture_stream()):
            graph.capture_begin(capture_error_mode="thread_local")
            scratch.add_(1)
            graph.capture_end()
        del graph
        torch.cuda.set_rng_state(state)
        torch.rand(1, device="cuda")  # an offset increment outside capture: fails if still poisoned
        torch.cuda.set_rng_state(state)
        torch.cuda.synchronize()
    except RuntimeError as e:
        raise CudaStatePoisoned(f"a failed CUDA graph capture left the CUDA generator unusable: {e}") from e


def _batch_size(args: tuple) -> int:
    sizes = []
    tree_map(lambda t: sizes.append(t.shape[0]) if t.dim() else None, args)
    return sizes[0] if sizes else 0
