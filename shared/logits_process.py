"""Penalties and filters on the target's logits, at every tree node, from that node's own prefix.

The features (vLLM's names and meanings): ``logit_bias`` (added), ``allowed_token_ids`` (every other
token masked), ``min_tokens`` (EOS and ``stop_token_ids`` masked while fewer outputs exist),
``repetition_penalty`` (a token of the prompt or the output: a positive logit divided by it, a
negative one multiplied), ``frequency_penalty`` and ``presence_penalty`` (subtracted per occurrence
in the output, and once for any occurrence), then ``min_p`` (after the temperature: tokens below
``min_p`` times the most likely token's probability masked; sampled rows only).

Under speculation the logits of tree node n predict the token after n, so its counts are those of the
committed tokens plus n's ancestors below the root, and n itself (the root is the last committed
token). ``process_logits`` applies everything with the committed counts to the whole [B, N, V] block,
then recomputes the few entries whose counts the tree changes (each node's ancestors' tokens) from
the raw logits: a handful of [B, N, N] gathers, no per-node copy of the counts. Target-only decoding
calls the same function with one node per request and no tree, so greedy speculative output equals
greedy target-only output with every feature.

Everything runs on the device from each request's rows, built once when it first needs them
(``logits_rows``) and kept there across steps by ``RowsCache``, which counts each step's committed tokens in
and gathers a batch's rows by index; a batch in which no request uses a feature builds nothing and launches
nothing here. A JSON schema (``shared/grammar.py``)
masks each node's logits with that node's grammar state, like ``allowed_token_ids`` (its masks are built
on the host, the only feature that is).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from kernels.spec_kernels import DraftTree
from shared.grammar import grammar_masks, unpack_masks
from shared.sampling import SamplingParams


def uses_processing(params: SamplingParams) -> bool:
    """Whether a request needs any of this module's features."""
    return bool(params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0
                or params.min_p or params.min_tokens or params.logit_bias or params.allowed_token_ids
                or params.json_schema is not None)


@dataclass
class LogitsRows:
    """One batch's penalties and filters, on the device. Padding rows are neutral (all zeros)."""

    counts: torch.Tensor  # [B, V] int32 occurrences of each token in the committed output
    seen: torch.Tensor  # [B, V] bool tokens of the prompt or the committed output
    bias: torch.Tensor  # [B, V] float32 logit_bias, -inf outside allowed_token_ids
    stop_ids: torch.Tensor  # [B, V] bool EOS and stop_token_ids, masked while outputs < min_tokens
    out_len: torch.Tensor  # [B] int64 committed output tokens
    min_tokens: torch.Tensor  # [B] int64
    presence: torch.Tensor  # [B] float32
    frequency: torch.Tensor  # [B] float32
    repetition: torch.Tensor  # [B] float32 (0 on padding rows: read as 1)
    min_p: torch.Tensor  # [B] float32
    temperature: torch.Tensor  # [B] float32 (min_p applies to sampled rows, after the temperature)
    # With a JSON schema in the batch (shared/grammar.py): each node's grammar mask, all bits set elsewhere
    grammar: torch.Tensor | None = None  # [B, N, ceil(V/32)] int32 packed allowed tokens


class RowsCache:
    """Each processed request's ``LogitsRows`` row, kept on the device from its first processed step to its
    end: built once from its prompt, parameters and the output it arrived with (a hand-off, a failover),
    then updated by the tokens committed since (counts, seen, out_len scatter-added); a batch's rows are
    one gather per tensor. Slot 0 is the padding row (neutral, never written). Owned by the engine (shared
    with its speculative worker); a request's slot is freed when the scheduler retires it (``release``)."""

    def __init__(self) -> None:
        self.pool: LogitsRows | None = None  # [S, V] rows of every slot (and [S] scalars)
        self.entries: dict[int, _Slot] = {}  # id(request) -> its slot, from its first processed step to its end
        self.free: list[int] = []  # unused slots (never 0)

    def rows(self, reqs: list, vocab: int, total: int, device: torch.device | str,
             index: torch.Tensor | None = None) -> LogitsRows | None:
        """The rows of ``reqs`` (``shared.request.Request``) at batch rows ``index`` [n] of ``total`` (the
        first rows when None), the others padding; None when none of them uses a feature. No grammar."""
        if not any(uses_processing(r.params) for r in reqs):
            return None
        if self.pool is not None and self.pool.counts.shape[1] != vocab:
            raise ValueError(f"penalty rows: vocabulary {vocab}, the cache's is {self.pool.counts.shape[1]}")
        stale = [r for r in reqs if id(r) in self.entries and self.entries[id(r)].counted > len(r.output_ids)]
        for r in stale:  # an output that shrank (never expected): counted again from scratch
            self.free.append(self.entries.pop(id(r)).slot)
        self._admit([r for r in reqs if id(r) not in self.entries], vocab, device)
        self._count(reqs)
        dev = self.pool.counts.device
        slots = [self.entries[id(r)].slot for r in reqs]
        if index is None:
            where = torch.tensor(slots + [0] * (total - len(reqs)), dtype=torch.int64).to(dev, non_blocking=True)
        else:  # placed on the device: the index stays there
            slots = torch.tensor(slots, dtype=torch.int64).to(dev, non_blocking=True)
            where = torch.zeros(total, dtype=torch.int64, device=dev).index_copy_(0, index.to(dev), slots)
        return LogitsRows(**{f.name: getattr(self.pool, f.name).index_select(0, where)
                             for f in dataclasses.fields(LogitsRows) if f.name != "grammar"})

    def release(self, req) -> None:
        """``req`` ended (``Scheduler.retire``): its slot goes back, if it holds one."""
        e = self.entries.pop(id(req), None)
        if e is not None:
            self.free.append(e.slot)

    def _admit(self, reqs: list, vocab: int, device: torch.device | str) -> None:
        """Build the rows of requests new to the cache, each in a free slot (the pool grows by doubling)."""
        if not reqs:
            return
        if self.pool is None:
            self.pool = logits_rows([], [], [], [], vocab, 1, device)
        while len(self.free) < len(reqs):
            self._grow()
        slots = [self.free.pop() for _ in reqs]
        built = logits_rows([r.prompt_ids for r in reqs], [r.output_ids for r in reqs], [r.params for r in reqs],
                            [r.eos_ids for r in reqs], vocab, len(reqs), device)
        at = torch.tensor(slots, dtype=torch.int64, device=self.pool.counts.device)
        for f in dataclasses.fields(LogitsRows):
            if f.name != "grammar":
                getattr(self.pool, f.name).index_copy_(0, at, getattr(built, f.name))
        for r, s in zip(reqs, slots):
            self.entries[id(r)] = _Slot(s, len(r.output_ids))

    def _grow(self) -> None:
        """Double the pool's slots (new ones zero: neutral)."""
        size = self.pool.counts.shape[0]
        self.pool = LogitsRows(**{f.name: torch.cat([t, torch.zeros_like(t)]) for f in dataclasses.fields(LogitsRows)
                                  if (t := getattr(self.pool, f.name)) is not None})
        self.free.extend(range(2 * size - 1, size - 1, -1))

    def _count(self, reqs: list) -> None:
        """Scatter-add the output tokens committed since each request's last count: one copy to the device."""
        slot, tok, seen_slot, seen_tok, len_slot, lens = [], [], [], [], [], []
        for r in reqs:
            e = self.entries[id(r)]
            new = r.output_ids[e.counted:]
            if not new:
                continue
            slot += [e.slot] * len(new)
            tok += new
            if r.params.repetition_penalty != 1.0:
                seen_slot += [e.slot] * len(new)
                seen_tok += new
            len_slot.append(e.slot)
            lens.append(len(r.output_ids))
            e.counted = len(r.output_ids)
        if not slot:
            return
        k, j = len(slot), len(seen_slot)
        host = torch.tensor([slot + seen_slot + len_slot, tok + seen_tok + lens], dtype=torch.int64)
        dev = host.to(self.pool.counts.device, non_blocking=True)
        p = self.pool
        p.counts.index_put_((dev[0, :k], dev[1, :k]), torch.ones(k, dtype=torch.int32, device=dev.device),
                            accumulate=True)
        if j:
            p.seen.index_put_((dev[0, k:k + j], dev[1, k:k + j]), torch.ones((), dtype=torch.bool, device=dev.device))
        p.out_len.index_copy_(0, dev[0, k + j:], dev[1, k + j:])


@dataclass
class _Slot:
    slot: int  # its row of the pool
    counted: int  # output tokens counted into the row


def add_grammar(rows: LogitsRows, reqs: list, tree: DraftTree | None = None,
                index: torch.Tensor | None = None) -> LogitsRows:
    """``rows`` with the grammar masks of ``reqs`` (at batch rows ``index``, else the first rows; every bit set
    elsewhere), when one of them has a grammar. ``tree``: the draft tree the logits are of (its first rows
    are ``reqs``'), else one node per request. Reads the tree's tokens back to the host (masks are built there)."""
    if not any(r.grammar is not None for r in reqs):
        return rows
    total, vocab = rows.counts.shape
    n = len(reqs)
    tokens, parents = (None, None) if tree is None else (tree.tokens[:n].tolist(), tree.parents[:n].tolist())
    masks = grammar_masks([r.grammar for r in reqs], tokens, parents, vocab, total if index is None else n,
                          rows.counts.device)
    if index is not None:
        masks = masks.new_full((total, *masks.shape[1:]), -1).index_copy_(0, index, masks)
    return dataclasses.replace(rows, grammar=masks)


def logits_rows(prompts: list[list[int]], outputs: list[list[int]], params: list[SamplingParams],
                eos_ids: list[tuple[int, ...]], vocab: int, rows: int, device: torch.device | str) -> LogitsRows:
    """The ``LogitsRows`` of requests (prompt ids, committed output ids, parameters, EOS ids), padded to
    ``rows``."""
    n = len(params)
    counts = _scatter_counts(list(outputs) + [[]] * (rows - n), vocab, device)
    seen = _scatter_counts([p + o if q.repetition_penalty != 1.0 else []
                            for p, o, q in zip(prompts, outputs, params)] + [[]] * (rows - n), vocab, device) > 0
    bias = torch.zeros(rows, vocab + 1, dtype=torch.float32)
    stop_ids = torch.zeros(rows, vocab + 1, dtype=torch.bool)
    for i, q in enumerate(params):
        if q.allowed_token_ids:
            allowed = torch.full((vocab + 1,), -math.inf)
            allowed[list(q.allowed_token_ids)] = 0.0
            bias[i] = allowed
        for tok, b in q.logit_bias:
            bias[i, tok] += b
        if q.min_tokens:
            stop_ids[i, [t for t in (*q.stop_token_ids, *(() if q.ignore_eos else eos_ids[i])) if t < vocab]] = True

    def col(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values + [0] * (rows - n), dtype=dtype)

    host = LogitsRows(
        counts=counts, seen=seen, bias=bias[:, :vocab], stop_ids=stop_ids[:, :vocab],
        out_len=col([len(o) for o in outputs], torch.int64),
        min_tokens=col([q.min_tokens for q in params], torch.int64),
        presence=col([q.presence_penalty for q in params], torch.float32),
        frequency=col([q.frequency_penalty for q in params], torch.float32),
        repetition=col([q.repetition_penalty for q in params], torch.float32),
        min_p=col([q.min_p for q in params], torch.float32),
        temperature=col([q.temperature for q in params], torch.float32))
    return LogitsRows(**{k: v.to(device) for k, v in vars(host).items() if v is not None})


def _scatter_counts(ids: list[list[int]], vocab: int, device: torch.device | str) -> torch.Tensor:
    """[len(ids), vocab] int32 occurrences, counted on the device from one padded id tensor."""
    width = max((len(x) for x in ids), default=0)
    padded = torch.tensor([x + [vocab] * (width - len(x)) for x in ids], dtype=torch.int64).view(len(ids), width)
    out = torch.zeros(len(ids), vocab + 1, dtype=torch.int32, device=device)
    out.scatter_add_(1, padded.to(device), torch.ones(padded.shape, dtype=torch.int32, device=device))
    return out[:, :vocab]


def _penalize(logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor, rows: LogitsRows) -> torch.Tensor:
    """Repetition, then frequency and presence penalties; shapes broadcast as [B, N or 1, V or N]."""
    rep = torch.where(rows.repetition > 0, rows.repetition, 1.0).view(-1, 1, 1)
    rep = torch.where(seen, rep, 1.0)  # [B, 1 or N, V or N]: dividing or multiplying by 1 leaves unseen tokens be
    out = torch.where(logits > 0, logits / rep, logits * rep)
    return out.sub_(rows.frequency.view(-1, 1, 1) * counts).sub_(rows.presence.view(-1, 1, 1) * (counts > 0))


def process_logits(logits: torch.Tensor, rows: LogitsRows, tokens: torch.Tensor | None = None,
                   mask: torch.Tensor | None = None, depths: torch.Tensor | None = None) -> torch.Tensor:
    """[B, N, V] logits after every feature, node n counted with its prefix: the committed tokens and,
    given a tree (``tokens`` [B, N], ``mask`` [B, N, N] ancestor-or-self, ``depths`` [B, N]), the
    tokens of n's ancestors below the root and n's own."""
    B, N, V = logits.shape
    raw = logits + rows.bias.unsqueeze(1)  # float32 (bias's), a new tensor: masked in place below
    if rows.grammar is not None:
        raw.masked_fill_(~unpack_masks(rows.grammar, V), -math.inf)
    depth = depths if depths is not None else torch.zeros(B, N, dtype=torch.int64, device=logits.device)
    early = (rows.out_len.unsqueeze(1) + depth < rows.min_tokens.unsqueeze(1)).unsqueeze(2)  # [B, N, 1]
    raw.masked_fill_(early & rows.stop_ids.unsqueeze(1), -math.inf)
    out = _penalize(raw, rows.counts.unsqueeze(1).float(), rows.seen.unsqueeze(1), rows)
    if tokens is not None and N > 1:
        out = _tree_prefix(out, raw, rows, tokens, mask)
    return _min_p(out, rows)


def _tree_prefix(out: torch.Tensor, raw: torch.Tensor, rows: LogitsRows, tokens: torch.Tensor,
                 mask: torch.Tensor) -> torch.Tensor:
    """Recompute, at node n, the penalised logit of each token on n's path (ancestors below the root,
    and n) with the committed count plus its occurrences on that path. Written in place: node m's entry by
    every node of the same token, all with one value."""
    B, N, V = out.shape
    on_path = mask.clone()
    on_path[:, :, 0] = False  # the root is committed already
    same = tokens.unsqueeze(2) == tokens.unsqueeze(1)  # [B, m, m'] same token
    extra = (on_path.unsqueeze(2) & same.unsqueeze(1)).sum(-1)  # [B, n, m]: occurrences of token m on n's path
    idx = tokens.unsqueeze(1).expand(B, N, N)  # [B, n, m] token of node m
    base = rows.counts.gather(1, tokens).unsqueeze(1).float() + extra  # [B, n, m]
    fixed = _penalize(raw.gather(2, idx), base, torch.ones_like(on_path), rows)
    return out.scatter_(2, idx, torch.where(extra > 0, fixed, out.gather(2, idx)))  # token m off the path: kept


def _min_p(logits: torch.Tensor, rows: LogitsRows) -> torch.Tensor:
    """Mask the tokens whose probability at the row's temperature is below min_p times the largest."""
    sampled = (rows.temperature > 0) & (rows.min_p > 0)
    temp = torch.where(sampled, rows.temperature, 1.0).view(-1, 1, 1)
    z = logits / temp
    floor = z.amax(-1, keepdim=True) + torch.log(torch.where(sampled, rows.min_p, 1.0)).view(-1, 1, 1)
    floor = torch.where(sampled.view(-1, 1, 1), floor, -math.inf)  # [B, N, 1] nothing below it elsewhere
    return logits.masked_fill_(z < floor, -math.inf)
