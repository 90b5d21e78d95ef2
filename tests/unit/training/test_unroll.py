"""The unrolled objective computes what serving computes.

A head is trained on ``Unroll``'s dense forwards but served by the engine's paged ones; if they
differed (a position, a mask, a key the step should not see, the wrong layer of a multi-layer draft),
training would optimise something the engine never runs. Here a random head of each kind is written
in its public format, loaded with ``load_draft`` (fused, as served), and run the way a decode step
runs it: the draft extend over the committed positions 0..t with the target's features, then draft
steps at positions t+1, t+2, ... fed the previous step's hidden state, each in the cache of its step,
seeing the committed prefix and its own earlier steps. Step j's logits at anchor t must equal the
unrolled step j's at row t.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import shared.training.unroll as unroll_mod
from shared.config import EngineConfig
from shared.forward_batch import build_forward_batch
from shared.memory.sizing import make_cache
from shared.model.drafts import load_draft
from shared.model.loader import load_target
from shared.training.corpus import draft_vocabulary, vocab_maps
from shared.training.heads import head_config, new_head, write_head
from shared.training.targets import TargetRunner
from shared.training.unroll import Unroll, chain_estimate, shift

STEPS = 4
T = 12


def random_head(kind: str, target, target_cfg: dict, hot: torch.Tensor | None, seed: int):
    layers = {"eagle3": 1, "eagle": 2, "mtp": STEPS}[kind]
    cfg = head_config(kind, target_cfg, layers, None if hot is None else hot.numel())
    torch.manual_seed(seed)
    head = new_head(kind, cfg, target, torch.device("cpu"))
    with torch.no_grad():  # norms away from one, so a norm applied to the wrong tensor shows
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
    t2d = None
    if hot is not None:
        d2t, t2d = vocab_maps(hot, target.config.vocab_size)
        head.d2t.copy_(d2t)
    return cfg, head, t2d


def served_steps(target, draft, ids: list[int], t: int, steps: int) -> list[torch.Tensor]:
    """Logits of the served extend at position t and of draft steps 1..steps-1 after it, each step
    j fed token t+1+j (forced, as the unrolled objective feeds them) at position t+j."""
    config = EngineConfig(page_size=4, dtype="float32")
    L = t + 1
    capture = "aux" if draft.kind == "eagle3" else "last"
    tcache = make_cache(target.config, target.config.num_hidden_layers, config, 64)
    h = tcache.open()
    tcache.reserve(h, L)
    pos = torch.arange(L)
    batch = build_forward_batch(tcache, [h.row], [0], [L], torch.tensor(ids[:L]), pos, pos)
    out = target(batch, tcache, capture=capture, aux_layers=getattr(draft, "aux_layers", ()))
    feats = out.aux_hidden if capture == "aux" else out.hidden
    n_caches = steps if draft.kind == "mtp" else 1
    caches, logits = [], []
    for c in range(n_caches):  # every cache runs the extend, as SpecWorker.draft_extend does
        cache = make_cache(draft.config, draft.layers_per_cache, config, 64)
        row = cache.open()
        cache.reserve(row, L + steps)
        batch = build_forward_batch(cache, [row.row], [0], [L], torch.tensor(ids[1:L + 1]), pos, pos,
                                    logits_rows=torch.tensor([L - 1]))
        o = draft(batch, cache, c, feats, from_target=True)
        caches.append((cache, row.row))
        if c == 0:
            logits.append(o.logits[0])
            hidden = o.hidden[L - 1:L]
    written = [0] * n_caches
    for j in range(1, steps):
        c = draft.cache_for_step(j) if draft.kind == "mtp" else 0
        cache, row = caches[c]
        n = written[c]
        batch = build_forward_batch(cache, [row], [L + n], [1], torch.tensor([ids[t + 1 + j]]),
                                    torch.tensor([t + j]), torch.tensor([L + n]))
        o = draft(batch, cache, c, hidden, from_target=False)
        written[c] += 1
        logits.append(o.logits[0])
        hidden = o.hidden
    return logits


@pytest.mark.parametrize("kind", ["eagle3", "eagle", "mtp"])
def test_unrolled_steps_equal_the_served_draft_steps(tiny_model_dir, tmp_path, monkeypatch, kind):
    target_dir = Path(tiny_model_dir) / "target"
    target_cfg = json.loads((target_dir / "config.json").read_text())
    target = load_target(target_dir)
    V = target.config.vocab_size
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(2, V, (1, T), generator=gen)
    # EAGLE-3 with a draft vocabulary of half the target's (d2t in play); the others use the target's.
    hot = draft_vocabulary(torch.randint(0, V, (4000,), generator=gen), V, V // 2) if kind == "eagle3" else None
    cfg, head, t2d = random_head(kind, target, target_cfg, hot, seed=11)
    write_head(tmp_path / kind, cfg, head, t2d, torch.float32)
    served = load_draft(tmp_path / kind, target)

    capture = "aux" if kind == "eagle3" else "last"
    runner = TargetRunner(target, capture, getattr(head, "aux_layers", ()), 1, T, hot)
    unrolled = [x[0] for x in unrolled_logits(head, runner(ids))]
    for t in (0, 3, T - STEPS - 1):
        want = served_steps(target, served, ids[0].tolist(), t, STEPS)
        for j in range(STEPS):
            err = (unrolled[j][t] - want[j]).abs().max().item()
            assert err < 1e-4, f"{kind}: step {j} at anchor {t}: max |logit diff| {err:.2e}"
            assert want[j].abs().max() > 0.1  # logits with something in them
    # Controls with teeth: steps rotated at the extend's positions (t, not t + j), or a step that does
    # not see its own anchor's earlier steps, compute something else than what is served.
    first = served_steps(target, served, ids[0].tolist(), 0, STEPS)[STEPS - 1]
    project, attend = unroll_mod.project_kv, unroll_mod.attend
    with monkeypatch.context() as m:
        m.setattr(unroll_mod, "project_kv", lambda attn, x, positions: project(attn, x, positions - positions[0]))
        assert (unrolled_logits(head, runner(ids))[STEPS - 1][0, 0] - first).abs().max() > 1e-3
    if kind != "mtp":  # (a multi-layer draft's step j is its layer's only step: nothing earlier to see)
        with monkeypatch.context() as m:
            m.setattr(unroll_mod, "attend", lambda attn, q, prefix, own: attend(attn, q, prefix, own[-1:]))
            assert (unrolled_logits(head, runner(ids))[STEPS - 1][0, 0] - first).abs().max() > 1e-3


@torch.no_grad()
def unrolled_logits(head, batch) -> list[torch.Tensor]:
    """[B, T, Vd] logits of each unrolled step."""
    unroll, out, fed = Unroll(head, batch), [], None
    for j in range(STEPS):
        o = unroll.step(j, fed)
        out.append(o.logits)
        fed = o.hidden
    return out


def test_shift_moves_rows_back_and_pads_with_zeros():
    x = torch.arange(10).view(2, 5)
    assert shift(x, 0) is x
    assert shift(x, 2).tolist() == [[2, 3, 4, 0, 0], [7, 8, 9, 0, 0]]


def test_chain_estimate_is_one_plus_the_running_products():
    assert chain_estimate([]) == 1.0
    assert chain_estimate([1.0, 1.0, 1.0]) == 4.0
    assert abs(chain_estimate([0.5, 0.5]) - (1 + 0.5 + 0.25)) < 1e-12
