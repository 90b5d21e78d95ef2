"""A direct, by-hand draft computation to hold the engine's speculative loop against.

``reference_extend`` runs the target over a request's committed tokens in a fresh cache (one
prefill, no chunks, no tree), then every draft layer over the same positions in fresh caches of its
own: draft position t takes (target feature at t, token t+1), the token after the last committed one
being the bonus token. ``reference_chain`` then runs draft step i at position L + i with the token
the previous step chose, on the layer (and cache) of that step. Nothing here uses shared/spec: the
positions, the tail token, the scratch layout and the cache of each step are written out again.

``DraftCalls`` records every forward of a draft head inside an engine (the tensors it was given and
returned), so a test can compare the loop's own numbers with these.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shared.engine import Engine
from shared.forward_batch import build_forward_batch
from shared.memory.kv_cache import KVCache
from shared.memory.sizing import make_cache
from shared.request import Request


@dataclass
class DraftCall:
    cache_index: int
    cache: KVCache
    from_target: bool
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    kv_indices: torch.Tensor
    kv_indptr: torch.Tensor
    features: torch.Tensor
    logits: torch.Tensor
    hidden: torch.Tensor


class DraftCalls:
    """Context manager: records the draft head's forwards (the head may be shared by engines)."""

    def __init__(self, engine: Engine):
        self.draft = engine.speculator.draft
        self.calls: list[DraftCall] = []

    def _hook(self, module, args, kwargs, out):
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return  # a CUDA graph being captured (on padding inputs): no host reads allowed, nothing to see
        batch, cache, c, features = args
        self.calls.append(DraftCall(
            cache_index=c, cache=cache, from_target=kwargs["from_target"], input_ids=batch.input_ids.clone(),
            positions=batch.positions.clone(), out_cache_loc=batch.out_cache_loc.clone(),
            # on CUDA kv_indices is a static buffer: only its first kv_indptr[-1] entries are the batch's
            kv_indices=batch.attn.kv_indices[:int(batch.attn.kv_indptr[-1])].clone(),
            kv_indptr=batch.attn.kv_indptr.clone(), features=features.clone(),
            logits=out.logits.clone(),
            hidden=out.hidden.clone()))

    def __enter__(self) -> DraftCalls:
        self._handle = self.draft.register_forward_hook(self._hook, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()

    def loop(self) -> list[DraftCall]:
        """The draft-loop forwards (tree growth), in order."""
        return [c for c in self.calls if not c.from_target]


@dataclass
class Reference:
    L: int  # committed length
    ids: list[int]  # committed tokens + the bonus token
    target_k: list[torch.Tensor]  # per target layer [L, Hkv, D]
    target_v: list[torch.Tensor]
    draft_k: list[list[torch.Tensor]]  # per draft cache, per layer [L, Hkv, D]
    draft_v: list[list[torch.Tensor]]
    hidden: torch.Tensor  # [Hd] draft hidden state at L - 1 (cache 0's layer)
    logits: torch.Tensor  # [Vd] draft logits at L - 1: the first tree level
    _caches: list[tuple[KVCache, int]] = field(default_factory=list)  # (fresh draft cache, row)


def _fresh(engine: Engine, config, num_layers: int, need: int) -> tuple[KVCache, int]:
    cache = make_cache(config, num_layers, engine.config, engine.max_context)
    h = cache.open()
    cache.reserve(h, need)
    return cache, h.row


def reference_extend(engine: Engine, committed: list[int], bonus: int) -> Reference:
    w = engine.speculator
    L = len(committed)
    ids = list(committed) + [bonus]
    pos = torch.arange(L)
    # The target over the committed tokens, in one forward of a fresh cache.
    tcache, trow = _fresh(engine, engine.model.config, engine.model.config.num_hidden_layers, L)
    batch = build_forward_batch(tcache, [trow], [0], [L], torch.tensor(committed), pos, pos)
    out = engine.model(batch, tcache, capture=w.capture_mode, aux_layers=w.aux_layers)
    feats = out.aux_hidden if w.capture_mode == "aux" else out.hidden
    assert feats.shape[-1] == w.draft.feature_width(from_target=True)
    slots = tcache.req_to_token.host[trow, :L]
    ref = Reference(L=L, ids=ids, target_k=[k[slots].clone() for k in tcache.k],
                    target_v=[v[slots].clone() for v in tcache.v], draft_k=[], draft_v=[],
                    hidden=torch.empty(0), logits=torch.empty(0))
    # Every draft cache (one per layer of a multi-layer draft) over positions 0..L-1, tokens 1..L.
    steps = w.spec.steps
    for c in range(len(w.caches)):
        cache, row = _fresh(engine, w.draft.config, w.draft.layers_per_cache, L + steps + 1)
        batch = build_forward_batch(cache, [row], [0], [L], torch.tensor(ids[1:]), pos, pos,
                                    logits_rows=torch.tensor([L - 1]))
        o = w.draft(batch, cache, c, feats, from_target=True)
        s = cache.req_to_token.host[row, :L]
        ref.draft_k.append([k[s].clone() for k in cache.k])
        ref.draft_v.append([v[s].clone() for v in cache.v])
        ref._caches.append((cache, row))
        if c == 0:
            ref.hidden, ref.logits = o.hidden[L - 1].clone(), o.logits[0].clone()
    return ref


@dataclass
class ChainStep:
    token: int  # target id fed at this step
    position: int
    cache_index: int
    logits: torch.Tensor  # [Vd]


def reference_chain(engine: Engine, ref: Reference) -> list[ChainStep]:
    """The ``steps - 1`` draft forwards of a chain (topk = 1) after ``ref``: step i (0-based) feeds the
    token chosen by the previous one at position L + i, with the previous hidden state, on the cache
    of draft step i + 1, where it sees the committed prefix and that cache's own earlier steps."""
    w = engine.speculator
    draft = w.draft
    L = ref.L
    token = int(draft.to_target_ids(ref.logits.argmax().view(1)))
    hidden = ref.hidden.view(1, -1)
    written: dict[int, int] = {}  # cache -> scratch positions used so far (after the prefix)
    out = []
    for i in range(w.spec.steps - 1):
        c = draft.cache_for_step(i + 1) if draft.kind == "mtp" else 0
        cache, row = ref._caches[c]
        n = written.get(c, 0)
        batch = build_forward_batch(cache, [row], [L + n], [1], torch.tensor([token]), torch.tensor([L + i]),
                                    torch.tensor([L + n]))
        o = draft(batch, cache, c, hidden, from_target=False)
        written[c] = n + 1
        out.append(ChainStep(token=token, position=L + i, cache_index=c, logits=o.logits[0].clone()))
        token = int(draft.to_target_ids(o.logits[0].argmax().view(1)))
        hidden = o.hidden
    return out


def engine_kv(engine: Engine, req: Request, length: int):
    """(target K, target V, [draft K per cache], [draft V per cache]) of ``req`` at positions [0, length)."""
    caches = engine.scheduler.caches
    per = []
    for cache, h in zip(caches, req.handles):
        s = cache.req_to_token.host[h.row, :length]
        per.append(([k[s].clone() for k in cache.k], [v[s].clone() for v in cache.v]))
    return per[0][0], per[0][1], [k for k, _ in per[1:]], [v for _, v in per[1:]]


def assert_kv_close(got: list[torch.Tensor], want: list[torch.Tensor], what: str, atol: float = 1e-4) -> None:
    assert len(got) == len(want), what
    for layer, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, f"{what} layer {layer}: {tuple(g.shape)} != {tuple(w.shape)}"
        err = (g - w).abs().max().item() if g.numel() else 0.0
        assert err <= atol, f"{what} layer {layer}: max |diff| {err:.2e}"


def assert_matches_reference(engine: Engine, req: Request, what: str = "") -> Reference:
    """The request's caches and draft state equal a fresh by-hand computation of its committed tokens."""
    st = req.draft_state
    L = st.committed_len
    ids = req.all_ids
    assert L == req.kv_len and st.bonus_token == ids[L], f"{what}: state {L}/{st.bonus_token} vs tokens"
    ref = reference_extend(engine, ids[:L], ids[L])
    tk, tv, dk, dv = engine_kv(engine, req, L)
    assert_kv_close(tk, ref.target_k, f"{what} target K")
    assert_kv_close(tv, ref.target_v, f"{what} target V")
    for c in range(len(dk)):
        assert_kv_close(dk[c], ref.draft_k[c], f"{what} draft cache {c} K")
        assert_kv_close(dv[c], ref.draft_v[c], f"{what} draft cache {c} V")
    assert torch.allclose(st.hidden.float(), ref.hidden.float(), atol=1e-4), f"{what}: draft hidden state"
    k = engine.speculator.spec.topk
    want_p, want_ids = torch.softmax(ref.logits, -1).topk(k)
    assert torch.allclose(st.topk_p.float(), want_p, atol=1e-4), f"{what}: first tree level probabilities"
    ids = engine.speculator.draft.to_target_ids(want_ids).cpu()
    assert torch.equal(st.topk_ids.cpu(), ids), f"{what}: tree level ids"
    return ref
