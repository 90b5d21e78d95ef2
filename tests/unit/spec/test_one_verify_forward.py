"""A decode step with speculation runs exactly one target forward: the verify of every tree node of
every request, in one batch.

The target module's ``forward`` is wrapped to count its calls (the drafts share its embedding and LM
head, submodules whose own calls are not target forwards). After the prompts are prefilled, every
engine step is a decode step of the running requests: it must call the target exactly once, over
``num_draft_tokens`` query tokens per request (the tree, root included), whatever the batch size,
and commit one verify per request. The draft forwards of the step are counted too: ``steps - 1``
loop forwards (one per draft step, all requests and leaves batched) and one extend per draft cache.
For every draft kind, chain and tree, and with requests finishing at different steps (the batch
shrinks as they do).
"""

from __future__ import annotations

import pytest
from spec_helpers import KINDS, PROMPTS

from shared.sampling import SamplingParams

SHAPES = {"chain": dict(topk=1, steps=3, ndt=4), "tree": dict(topk=2, steps=3, ndt=8)}
BATCH = [PROMPTS[0], PROMPTS[2], PROMPTS[4]]  # 3, 7 and 18 tokens


class Counting:
    """Wraps a module's forward; records the number of query tokens of each call."""

    def __init__(self, module, monkeypatch):
        self.calls: list[dict] = []
        forward = module.forward

        def counted(batch, *args, **kwargs):
            self.calls.append(dict(tokens=batch.num_tokens, from_target=kwargs.get("from_target")))
            return forward(batch, *args, **kwargs)

        monkeypatch.setattr(module, "forward", counted)

    def take(self) -> list[dict]:
        calls, self.calls = self.calls, []
        return calls


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kind", KINDS)
def test_one_target_forward_per_verify(oracle_models, monkeypatch, kind, shape):
    s = SHAPES[shape]
    engine = oracle_models.fixed(kind, s["topk"], s["steps"], s["ndt"], page_size=4, chunk_size=None)
    target = Counting(engine.model, monkeypatch)
    draft = Counting(engine.speculator.draft, monkeypatch)
    # different lengths: requests leave the batch at different decode steps
    reqs = [engine.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True))
            for p, n in zip(BATCH, (6, 11, 16))]
    engine.step()  # every prompt in one prefill forward (no chunking)
    assert len(target.take()) == 1 and all(r.draft_state is not None for r in reqs)
    draft.take()
    decode_steps = 0
    sizes = set()
    while engine.scheduler.has_work():
        running = [r for r in reqs if r.finish_reason is None]
        verifies = [r.stats.verify_steps for r in running]
        engine.step()
        calls = target.take()
        assert len(calls) == 1, f"decode step {decode_steps}: {len(calls)} target forwards"
        assert calls[0]["tokens"] == len(running) * s["ndt"], "the verify covers every node of every request"
        assert [r.stats.verify_steps for r in running] == [v + 1 for v in verifies]
        drafted = draft.take()
        loop = [c for c in drafted if not c["from_target"]]
        extend = [c for c in drafted if c["from_target"]]
        assert len(loop) == s["steps"] - 1 and all(c["tokens"] == len(running) * s["topk"] for c in loop)
        assert len(extend) == len(engine.speculator.caches)
        decode_steps += 1
        sizes.add(len(running))
    assert engine.is_idle_and_clean()
    assert sizes == {1, 2, 3}, f"batch sizes seen: {sizes}"
    assert decode_steps == max(r.stats.verify_steps for r in reqs)
    assert sum(r.stats.accepted_drafts for r in reqs) > 0  # drafts accepted, verify still one forward
