"""DraftState, the per-request draft state prefill hands to decode: a byte round trip keeps every
field (values, dtypes, shapes, the seed), a schema version mismatch is refused, and a
request whose state is replaced mid-run by its round-tripped copy decodes exactly as before."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from spec_helpers import KINDS, PROMPTS

from shared.sampling import SamplingParams
from shared.spec.state import SCHEMA_VERSION, DraftState


def example(dtype=torch.float32, seeded: bool = True) -> DraftState:
    g = torch.Generator().manual_seed(4)
    return DraftState(bonus_token=321, committed_len=45, hidden=torch.randn(64, generator=g).to(dtype),
                      topk_p=torch.rand(4, generator=g), topk_ids=torch.tensor([9, 200, 3, 511]),
                      seed=2 ** 64 - 1 if seeded else None)


def assert_same(a: DraftState, b: DraftState) -> None:
    assert (a.bonus_token, a.committed_len, a.seed) == (b.bonus_token, b.committed_len, b.seed)
    for name in ("hidden", "topk_p", "topk_ids"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seeded", [True, False])
def test_round_trip_keeps_every_field(dtype, seeded):
    state = example(dtype, seeded)
    data = state.to_bytes()
    assert isinstance(data, bytes)
    back = DraftState.from_bytes(data)
    assert_same(back, state)
    assert DraftState.from_bytes(back.to_bytes()).to_bytes() == data  # stable encoding


def test_every_field_is_carried():
    """Changing any field changes the bytes, and the change comes back."""
    base = example()
    changes = {"bonus_token": 322, "committed_len": 46, "hidden": base.hidden + 1, "topk_p": base.topk_p / 2,
               "topk_ids": base.topk_ids.flip(0), "seed": (1 << 63) + 5}
    assert set(changes) == set(DraftState.__dataclass_fields__)
    for name, value in changes.items():
        other = DraftState(**{**base.__dict__, name: value})
        assert other.to_bytes() != base.to_bytes(), name
        assert_same(DraftState.from_bytes(other.to_bytes()), other)


@pytest.mark.parametrize("version", [SCHEMA_VERSION + 1, 0, None])
def test_schema_version_mismatch_is_refused(version):
    data = example().to_bytes()
    (n,) = struct.unpack("<I", data[:4])
    header = json.loads(data[4:4 + n])
    assert header["version"] == SCHEMA_VERSION
    header["version"] = version
    head = json.dumps(header).encode()
    with pytest.raises(ValueError, match=f"version {version} != {SCHEMA_VERSION}"):
        DraftState.from_bytes(struct.pack("<I", len(head)) + head + data[4 + n:])


@pytest.mark.parametrize("kind", KINDS)
def test_resuming_from_the_round_tripped_state(oracle_models, kind):
    """Mid-run, every request's state is replaced by its round-tripped copy (a sampled one's seed with
    it): the outputs do not change."""
    params = [SamplingParams(max_new_tokens=14, ignore_eos=True),
              SamplingParams(temperature=0.9, top_k=20, seed=5, max_new_tokens=14, ignore_eos=True)]
    prompts = [PROMPTS[3], PROMPTS[4]]
    outputs = []
    for swap in (False, True):
        engine = oracle_models.engine(kind, topk=2, steps=3, ndt=6)
        reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        steps = 0
        while engine.scheduler.has_work():
            engine.step()
            steps += 1
            if swap and steps in (1, 3):
                for r in reqs:
                    if r.finish_reason is None and r.draft_state is not None:
                        st = r.draft_state
                        st = DraftState(st.bonus_token, st.committed_len, st.hidden, st.topk_p, st.topk_ids,
                                        r.seed)
                        back = DraftState.from_bytes(st.to_bytes())
                        assert back.hidden.shape == (engine.speculator.draft.hidden_width,)
                        r.draft_state = back
                        r.seed = back.seed
        assert engine.is_idle_and_clean()
        outputs.append([(r.output_ids, r.output_logprobs) for r in reqs])
    assert outputs[0] == outputs[1]
    assert outputs[0][0][0] == oracle_models.reference(prompts[:1], params[0])[0].token_ids
