"""Tensor parallelism: a group of ranks, each holding a slice of the target's weights and KV heads.

The target is split as Megatron-LM splits it. In each attention block q, k and v are split by heads
(column-parallel) and o by its input rows (row-parallel); in each MLP gate and up are split by columns
and down by rows. Each block's output is then a partial sum, and one all-reduce per block completes it.
The embedding and the LM head are split by vocabulary: a rank looks up only the ids of its own range
(the others' rows are zero, and the all-reduce adds them in exactly), and each rank computes the logits
of its range, which an all-gather joins, so sampling and verification always see the whole vocabulary.
A KV pool holds this rank's KV heads only; page ids are the same on every rank because the schedulers
make the same decisions.

The draft head is replicated: every rank runs the whole head (a layer or a few: splitting it would add
collectives to each of the draft's many small steps for little memory), and it reads the target's embedding
and LM head through the sharded modules above.

Rank 0's engine alone decides (checks, seeds, schedules, picks each step's kind); its model runner sends each
call that touches the device to the other ranks, which run the same call (``shared/replay.py``): the same plan
on the same requests, and the collectives leave the same hidden states and logits on every rank, so the same
tokens are drawn with the same per-request seeds. A follower whose pages differ from rank 0's after applying
its plan stops with an error instead of corrupting the pools.

Hand-offs leave and enter a split engine with every KV head (``gather_pages``, ``scatter_pages``), so a
prefill group and a decode group of different sizes fit each other.

Collectives run over NCCL on CUDA devices and gloo on the CPU; host objects (rank 0's calls) always go over
a gloo group (or a service's pipes), so they never wait on the device. On CUDA the device collectives of a
forward (the blocks' all-reduces, the embedding's, the LM head's all-gather) are captured inside the engine's
CUDA graphs like any kernel: NCCL runs them on the capture stream's fork and the graph replays them. Every
rank captures and replays the same graphs in the same order (the same plans), the communicator exists
before the first capture (``warm_up``), and nothing inside a captured phase talks over gloo.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import multiprocessing
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shared.memory.kv_cache import CacheLayout, KVCache
from shared.model.config import ModelConfig

TIMEOUT = timedelta(minutes=5)  # a rank that stops answering fails the others' collectives after this
# torch >= 2.13 names it all_gather_single; before, all_gather_into_tensor (same arguments)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class TPGroup:
    """This process's place in a tensor-parallel group."""

    rank: int  # 0 .. size - 1; rank 0 decides what the ranks must agree on
    size: int  # ranks in the group (2 or more)
    group: dist.ProcessGroup  # the device collectives (NCCL on CUDA, gloo on the CPU)
    control: dist.ProcessGroup  # host objects (gloo)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (every rank ends with the same tensor)."""
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' ``x`` side by side along ``dim`` (n -> size * n), rank 0's first. One output tensor
        (no list of parts), so that inside a CUDA graph the collective writes one buffer of the graph's pool."""
        stacked = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        _all_gather_single(stacked, x.contiguous(), group=self.group)
        d = dim % x.dim()
        return stacked.view(self.size, *x.shape).movedim(0, d).flatten(d, d + 1)

    def share(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` on every rank, in place (``x``: contiguous, the same shape everywhere)."""
        dist.broadcast(x, src=0, group=self.group)
        return x

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every rank (the others' argument is ignored)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def least(self, value: int) -> int:
        """The smallest of the ranks' ``value``s, on every rank."""
        x = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(x, op=dist.ReduceOp.MIN, group=self.control)
        return int(x)

    def agree(self, value: int, what: str) -> None:
        """Check that every rank computed rank 0's ``value`` (a digest of ``what``)."""
        x = torch.tensor([value], dtype=torch.int64)
        dist.broadcast(x, src=0, group=self.control)
        if int(x) != value:
            raise RuntimeError(f"tensor-parallel rank {self.rank}: {what} differs from rank 0's "
                               f"({value:#x} != {int(x):#x}); the ranks' engines diverged")

    def span(self, n: int, what: str) -> slice:
        """This rank's contiguous share of ``n`` items (heads, columns), which must split evenly."""
        if n % self.size:
            raise ValueError(f"tensor_parallel={self.size} does not divide {what} ({n})")
        k = n // self.size
        return slice(self.rank * k, (self.rank + 1) * k)


class GroupChannel:
    """Rank 0's calls to the other ranks (``ModelRunner.send``) over the group's host (gloo) group: a broadcast
    each, which the others wait in (up to ``TIMEOUT``: for a group whose rank 0 is never idle that long, as a
    test's or ``eyrie generate``'s; a service's ranks talk over pipes, ``services/followers.py``)."""

    def __init__(self, tp: TPGroup):
        self.tp = tp

    def send(self, message: tuple) -> None:
        self.tp.broadcast(message)

    def receive(self) -> tuple:
        return self.tp.broadcast(None)


# ---- starting a group ------------------------------------------------------------------------------
def rank_device(device: str, rank: int) -> str:
    """Rank ``rank``'s device: the ``rank``-th GPU from ``device``'s (``cuda`` = ``cuda:0``); the CPU stays."""
    if not device.startswith("cuda"):
        return device
    first = int(device.split(":")[1]) if ":" in device else 0
    return f"cuda:{first + rank}"


def init_group(size: int, rank: int, address: str, device: str) -> TPGroup:
    """Join the group of ``size`` ranks meeting at ``address`` (``host:port``, rank 0 listens there)."""
    if not device.startswith("cuda"):
        dist.init_process_group("gloo", init_method=f"tcp://{address}", world_size=size, rank=rank, timeout=TIMEOUT)
        return TPGroup(rank=rank, size=size, group=dist.group.WORLD, control=dist.group.WORLD)
    gpu = torch.device(rank_device(device, rank))
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", init_method=f"tcp://{address}", world_size=size, rank=rank, timeout=TIMEOUT,
                            device_id=gpu)  # the communicator bound to this rank's GPU
    tp = TPGroup(rank=rank, size=size, group=dist.group.WORLD, control=dist.new_group(backend="gloo", timeout=TIMEOUT))
    warm_up(tp, gpu)
    return tp


def warm_up(tp: TPGroup, gpu: torch.device) -> None:
    """One of each device collective the engine runs, completed before anything else: the NCCL communicator
    is created by the first collective, which must not happen inside a CUDA graph's capture."""
    x = torch.ones(8, device=gpu)
    tp.all_reduce(x)
    tp.all_gather(x)
    tp.share(x)
    torch.cuda.synchronize(gpu)
    if int(x[0]) != tp.size:
        raise RuntimeError(f"tensor-parallel rank {tp.rank}: the warm-up all-reduce gave {float(x[0])}, not {tp.size}")


def free_address() -> str:
    """``127.0.0.1:PORT`` with a port free now, for the group to meet at."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def leave_group(timeout_s: float = 30.0) -> bool:
    """This rank's part of ending the group: ``destroy_process_group``, which under NCCL waits for the other
    ranks' (each rank calls this as the others do, not after joining them) and hangs while a CUDA graph that
    captured its collectives lives (pytorch#115388: the caller releases its engines' graphs first); past
    ``timeout_s`` (a rank that died or never came) the group is aborted instead. True when it ended cleanly."""
    if not dist.is_initialized():
        return True
    gc.collect()  # engines gone out of use: their CUDA graphs (NCCL's destroy hangs while one lives) freed now
    done = threading.Thread(target=dist.destroy_process_group, name="eyrie-tp-leave", daemon=True)
    done.start()
    done.join(timeout_s)
    if not done.is_alive():
        return True
    with contextlib.suppress(Exception):  # aborting is local: it returns whatever state the peers are in
        dist.distributed_c10d._abort_process_group()
    return False


def _rank_main(rank: int, size: int, address: str, device: str, fn: Callable, args: tuple) -> None:
    try:
        tp = init_group(size, rank, address, device)
        fn(tp, *args)
    except BaseException:  # noqa: BLE001 (a rank's failure is reported on its stderr, then exit 1)
        traceback.print_exc()
        sys.exit(1)
    if not leave_group():
        sys.exit(1)


def start_ranks(ranks: range, size: int, address: str, device: str, fn: Callable, args: tuple) -> list:
    """``ranks`` of a group of ``size`` as processes (spawned, daemonic: they end with this one), each
    running ``fn(its TPGroup, *args)``. A caller that is itself rank 0 starts ``range(1, size)`` and joins
    with ``init_group(size, 0, ...)``."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(r, size, address, device, fn, args), daemon=True) for r in ranks]
    for p in procs:
        p.start()
    return procs


def join_ranks(procs: list, deadline: float) -> list[int | None]:
    """Wait for ``start_ranks``'s processes until ``deadline`` (``time.monotonic``), kill what is still running
    then; their exit codes (0: the rank's function returned)."""
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    return [p.exitcode for p in procs]


# ---- splitting a loaded target ---------------------------------------------------------------------
def check_split(config: ModelConfig, size: int) -> None:
    """A ``ValueError`` naming the first of the target's heads, KV heads or MLP width that ``size`` ranks
    cannot share evenly (the vocabulary is padded instead)."""
    for what in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        n = getattr(config, what)
        if n % size:
            raise ValueError(f"tensor_parallel={size} does not divide the target's {what} ({n})")


def local_config(config: ModelConfig, tp: TPGroup | None) -> ModelConfig:
    """``config`` with this rank's heads: the shape of its KV pools."""
    if tp is None:
        return config
    check_split(config, tp.size)
    return config.model_copy(update={"num_attention_heads": config.num_attention_heads // tp.size,
                                     "num_key_value_heads": config.num_key_value_heads // tp.size})


def _param(x: torch.Tensor, device: torch.device) -> nn.Parameter:
    return nn.Parameter(x.to(device).contiguous(), requires_grad=False)


def _rows(x: torch.Tensor | None, sizes: list[int], tp: TPGroup, what: str, device) -> torch.Tensor | None:
    """This rank's rows of each part of ``x`` (parts of ``sizes`` rows, e.g. q/k/v), concatenated."""
    if x is None:
        return None
    return torch.cat([p[tp.span(n, what)] for p, n in zip(x.split(sizes), sizes)]).to(device).contiguous()


def _split_row_parallel(linear: nn.Linear, tp: TPGroup, what: str, device: torch.device) -> None:
    """``linear`` takes this rank's share of its inputs; its bias is added once, by rank 0."""
    linear.weight = _param(linear.weight[:, tp.span(linear.weight.shape[1], what)], device)
    if linear.bias is not None:
        linear.bias = _param(linear.bias if tp.rank == 0 else torch.zeros_like(linear.bias), device)


@torch.no_grad()
def _split_attention(attn, tp: TPGroup, device: torch.device) -> None:
    if attn.qkv_weight is None:
        attn.fuse()
    hd, h, kv = attn.head_dim, attn.num_heads, attn.num_kv_heads
    tp.span(h, "num_attention_heads"), tp.span(kv, "num_key_value_heads")
    sizes = [h * hd, kv * hd, kv * hd]
    attn.qkv_weight = _rows(attn.qkv_weight, sizes, tp, "q/k/v rows", device)
    attn.qkv_bias = _rows(attn.qkv_bias, sizes, tp, "q/k/v bias", device)
    _split_row_parallel(attn.o_proj, tp, "o_proj inputs", device)
    attn.num_heads, attn.num_kv_heads, attn.tp = h // tp.size, kv // tp.size, tp


@torch.no_grad()
def _split_mlp(mlp, tp: TPGroup, device: torch.device) -> None:
    if mlp.gate_up_weight is None:
        mlp.fuse()
    inter = mlp.gate_up_weight.shape[0] // 2
    mlp.gate_up_weight = _rows(mlp.gate_up_weight, [inter, inter], tp, "intermediate_size", device)
    mlp.gate_up_bias = _rows(mlp.gate_up_bias, [inter, inter], tp, "intermediate_size", device)
    _split_row_parallel(mlp.down_proj, tp, "intermediate_size", device)
    mlp.tp = tp


def vocab_range(vocab_size: int, tp: TPGroup) -> tuple[int, int]:
    """The first token id of this rank's vocabulary rows and how many rows each rank holds (ceil(V / size):
    the last rank's run past V, padded with zero rows)."""
    per = -(-vocab_size // tp.size)
    return tp.rank * per, per


def vocab_shard(weight: torch.Tensor, tp: TPGroup) -> tuple[torch.Tensor, int]:
    """This rank's rows of a [V, H] vocabulary table (the last rank's padded with zero rows up to
    ceil(V / size)) and the first token id they hold."""
    start, per = vocab_range(weight.shape[0], tp)
    return pad_vocab_rows(weight[start:start + per], per), start


def pad_vocab_rows(part: torch.Tensor, rows: int) -> torch.Tensor:
    """``part`` (a rank's vocabulary rows) with zero rows up to ``rows`` (the last rank's run past V)."""
    if part.shape[0] >= rows:
        return part
    return torch.cat([part, part.new_zeros(rows - part.shape[0], *part.shape[1:])])


class VocabParallelEmbedding(nn.Module):
    """An embedding of which this rank holds the rows of ids [start, start + rows); the ranks' lookups sum."""

    def __init__(self, weight: nn.Parameter, start: int, tp: TPGroup):
        super().__init__()
        self.weight = weight  # [ceil(V / size), H] this rank's rows
        self.start = start
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(torch.where(mine, local, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(~mine.unsqueeze(-1), 0))


@torch.no_grad()
def shard_target(model: nn.Module, tp: TPGroup, device: torch.device) -> nn.Module:
    """Keep this rank's share of a loaded (fused) target's weights, on ``device``; the rest (norms, the
    rotary tables) moves there whole. In place; a target already split for ``tp`` is returned as is. (A target
    on disk is not loaded whole to be split: ``shared/model/shard_loader.py`` reads only the rank's share.)"""
    if model.tp is tp:
        return model
    if model.tp is not None:
        raise ValueError("the target is already split for another tensor-parallel group")
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    for layer in model.model.layers:
        _split_attention(layer.self_attn, tp, device)
        _split_mlp(layer.mlp, tp, device)
    table, start = vocab_shard(model.model.embed_tokens.weight, tp)
    embed = _param(table, device)
    model.model.embed_tokens = VocabParallelEmbedding(embed, start, tp)
    model.lm_head.weight = embed if tied else _param(vocab_shard(model.lm_head.weight, tp)[0], device)
    model.tp = tp
    return model.to(device)


# ---- handing a request to a group of another size ----------------------------------------------------
def page_slots(pages: list[int], page_size: int, device: torch.device) -> torch.Tensor:
    """[len(pages) * page_size] int64: the slots of ``pages`` in order."""
    slots = torch.tensor(pages, dtype=torch.int64)[:, None] * page_size + torch.arange(page_size)
    return slots.flatten().to(device)


def staging_cache(layout: CacheLayout, num_kv_heads: int, num_pages: int, shareable: bool = False) -> KVCache:
    """A cache of ``num_pages`` pages (ids 1 .. n) shaped as ``layout`` but with ``num_kv_heads`` heads: K/V with
    every rank's heads, on its way out of or into a split engine (``shareable``: a same-host prefill writes
    into it)."""
    return KVCache(dataclasses.replace(layout, num_kv_heads=num_kv_heads, num_pages=num_pages, max_reqs=1,
                                       max_context=num_pages * layout.page_size, shareable=shareable))


def staging_pages(n: int) -> list[int]:
    """The ids of a ``staging_cache``'s ``n`` pages, in order."""
    return list(range(1, n + 1))


def gather_pages(cache: KVCache, pages: list[int], tp: TPGroup) -> KVCache | None:
    """A collective: ``pages`` of ``cache`` with every rank's KV heads (rank 0's first, as the heads were
    split), on rank 0 in a ``staging_cache`` where they are pages 1 .. n in order; None on the others.
    What a split prefill sends to a decode engine of any split (the heads mapped back to the whole model's)."""
    staging = staging_cache(cache.layout, cache.layout.num_kv_heads * tp.size, len(pages)) if tp.rank == 0 else None
    gather_pages_into(staging, 0, cache, pages, tp)
    return staging


def gather_pages_into(staging: KVCache | None, first: int, cache: KVCache, pages: list[int], tp: TPGroup) -> None:
    """A collective: ``pages`` of ``cache`` with every rank's KV heads written on rank 0 into pages ``first + 1``
    .. ``first + len(pages)`` of ``staging`` (a ``staging_cache``; None on the other ranks), in place: a fed
    hand-off's pages, gathered as its prefill completes them."""
    ps = cache.page_size
    heads = tp.all_gather(cache.pool[:, :, page_slots(pages, ps, cache.pool.device)], dim=-2)
    if tp.rank == 0:
        staging.pool[:, :, (first + 1) * ps:(first + 1 + len(pages)) * ps] = heads


def scatter_pages(staging: KVCache | None, staged: list[int] | None, cache: KVCache, pages: list[int],
                  tp: TPGroup) -> None:
    """A collective, the reverse of ``gather_pages``: rank 0's pages ``staged`` of ``staging`` (every KV head;
    None on the other ranks) are sent to every rank, which writes its own heads into ``pages`` of ``cache``
    (in place)."""
    ps, lay = cache.page_size, cache.layout
    heads = lay.num_kv_heads * tp.size
    if tp.rank == 0:
        every = staging.pool[:, :, page_slots(staged, ps, staging.pool.device)]
    else:
        every = torch.empty((2, lay.num_layers, len(pages) * ps, heads, lay.head_dim), dtype=lay.dtype,
                            device=lay.device)
    tp.share(every)
    cache.pool[:, :, page_slots(pages, ps, cache.pool.device)] = every[:, :, :, tp.span(heads, "KV heads")]


def share_pages(cache: KVCache, pages: list[int], tp: TPGroup) -> None:
    """A collective: rank 0's K/V of ``pages`` of ``cache`` (a whole, replicated cache: the draft's) written
    into the same pages on every rank (in place)."""
    slots = page_slots(pages, cache.page_size, cache.pool.device)
    cache.pool[:, :, slots] = tp.share(cache.pool[:, :, slots])
