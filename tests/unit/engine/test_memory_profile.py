"""The measured reserve (``shared/memory/sizing.py``: the profile run's step peaks turned into the bytes the pools
leave free) and the peak check after warm-up, on injected figures (they run on the CPU); NVML's per-process
figure picked out of a process list. The profile run itself and the real peak are GPU paths:
tests/gpu/test_memory_promise_gpu.py starts prefill and decode at 0.45 each with an EAGLE-3 draft on one GPU."""

from __future__ import annotations

import pytest

from shared.config import EngineConfig, SpecConfig
from shared.memory.nvml import NOT_AVAILABLE, _ProcessInfo, own_usage
from shared.memory.sizing import (
    BASE_RESERVE,
    DeviceMemory,
    Footprint,
    GiB,
    StepPeaks,
    check_footprint,
    draft_phase_reserve,
    graph_output_reserve,
    graph_target_phases,
    pages_within_budget,
    profiled_reserve,
)
from shared.model.config import ModelConfig
from shared.request import RequestError

MB = 1 << 20
SPEC = SpecConfig(topk=1, steps=3)


@pytest.mark.parametrize(("config", "phases"), [
    (EngineConfig(cuda_graph=False), 0),
    (EngineConfig(cuda_graph=True), 1),  # the plain decode
    (EngineConfig(cuda_graph=True, cuda_graph_phases=("draft",)), 0),
    (EngineConfig(cuda_graph=True, spec=SPEC, spec_policy="fixed"), 1),  # verify, and verify + extend: one pool
    (EngineConfig(cuda_graph=True, spec=SPEC, spec_policy="fixed", cuda_graph_phases=("decode", "verify")), 1),
    (EngineConfig(cuda_graph=True, spec=SPEC, spec_policy="fixed", cuda_graph_phases=("draft", "extend")), 0),
])
def test_graph_phases_that_run_the_target_share_one_pool(config, phases):
    assert graph_target_phases(config) == phases


def test_an_adaptive_engine_keeps_room_for_one_pool_whatever_its_shapes():
    config = EngineConfig(cuda_graph=True, spec=SPEC, spec_policy="adaptive")
    assert len(config.spec_shapes()) > 1
    assert graph_target_phases(config) == 1


def test_the_reserve_is_the_eager_peak_a_pool_per_target_phase_the_draft_and_what_lies_outside_pytorch():
    peaks = StepPeaks(prefill=3 * GiB, decode=2 * GiB, graph=512 * MB, non_torch=700 * MB)
    assert profiled_reserve(peaks, target_phases=2, draft_phases=100 * MB) == 3 * GiB + 1024 * MB + 100 * MB + 700 * MB
    decode_heavy = StepPeaks(prefill=1 * GiB, decode=4 * GiB, graph=0, non_torch=None)  # no NVML: the base guess
    assert profiled_reserve(decode_heavy, 0, 0) == 4 * GiB + BASE_RESERVE


def test_the_draft_phases_grow_with_the_captured_rows_and_vanish_without_graphs_or_draft():
    mc = ModelConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    small = draft_phase_reserve(mc, EngineConfig(cuda_graph=True, spec=SPEC, max_running=8, spec_policy="fixed"))
    assert small == 2 * 8 * SPEC.num_draft_tokens * 1000 * 4 * 2
    assert draft_phase_reserve(mc, EngineConfig(cuda_graph=True, spec=SPEC, max_running=64, cuda_graph_max_bs=32,
                                                spec_policy="fixed")) == 4 * small  # 32 rows
    assert draft_phase_reserve(mc, EngineConfig(cuda_graph=True, spec=SPEC, max_running=64,
                                                spec_policy="fixed")) == 8 * small  # graphs up to max_running
    adaptive = EngineConfig(cuda_graph=True, spec=SpecConfig(topk=4, steps=4, num_draft_tokens=16), max_running=8)
    assert len(adaptive.spec_shapes()) > 1  # the shapes share the pool: the one with the most rows counts
    assert draft_phase_reserve(mc, adaptive) == 2 * 8 * 16 * 1000 * 4 * 2
    assert draft_phase_reserve(mc, EngineConfig(cuda_graph=False, spec=SPEC)) == 0
    assert draft_phase_reserve(mc, EngineConfig(cuda_graph=True)) == 0


def test_a_phase_keeps_one_set_of_outputs_at_its_largest_batch_logits_and_features_per_verified_token():
    """Buckets 1, 2, 4, 8, 16, 24 (graphs up to 24 rows) write one buffer: 24 rows per phase and token, bf16."""
    mc = ModelConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    row = (1000 + 192) * 2  # logits and three layers' features of one token
    fixed = EngineConfig(cuda_graph=True, spec=SPEC, max_running=24, spec_policy="fixed", dtype="bfloat16")
    assert graph_output_reserve(mc, fixed, 192) == 24 * SPEC.num_draft_tokens * row
    adaptive = EngineConfig(cuda_graph=True, spec=SPEC, max_running=24, spec_policy="adaptive", dtype="bfloat16")
    tokens = sum(s.num_draft_tokens for s in adaptive.spec_shapes())
    assert tokens > SPEC.num_draft_tokens
    assert graph_output_reserve(mc, adaptive, 192) == 24 * (tokens + 1) * row  # and the plain step's logits
    assert graph_output_reserve(mc, EngineConfig(cuda_graph=True, max_running=24, dtype="float32"), 0) \
        == 24 * 1000 * 4
    assert graph_output_reserve(mc, EngineConfig(cuda_graph=False, spec=SPEC), 192) == 0


def test_a_larger_measured_peak_leaves_fewer_pages_and_a_layout_that_cannot_fit_names_the_figures():
    memory = DeviceMemory(total=80 * GiB, free=70 * GiB, weights=17 * GiB)  # the 8B shape and its EAGLE-3 head
    guessed = pages_within_budget(0.45, memory, 2 * GiB, 2 * MB, request_pages=520, most_pages=10**9)
    measured = profiled_reserve(StepPeaks(prefill=6 * GiB, decode=1 * GiB, graph=1 * GiB, non_torch=1 * GiB), 2, 0)
    pages = pages_within_budget(0.45, memory, measured, 2 * MB, request_pages=520, most_pages=10**9)
    assert pages == guessed - (measured - 2 * GiB) // (2 * MB)
    assert 17 * GiB + measured + (pages + 1) * 2 * MB <= 0.45 * 80 * GiB
    with pytest.raises(RequestError) as e:
        pages_within_budget(0.25, memory, measured, 2 * MB, request_pages=520, most_pages=10**9)
    text = str(e.value)
    assert e.value.field == "gpu_memory_fraction" and "\n" not in text
    assert all(f in text for f in ("0.25 x 80.00 GiB", "17.00 GiB", f"{measured / GiB:.2f} GiB", "520 pages"))


def test_the_peak_check_passes_within_the_fraction_and_names_every_figure_past_it():
    within = Footprint(torch_peak=34 * GiB, non_torch=1 * GiB, device_total=80 * GiB, fraction=0.45)
    check_footprint(within)
    assert within.peak == 35 * GiB and within.budget == int(0.45 * 80 * GiB)
    over = Footprint(torch_peak=41 * GiB, non_torch=1 * GiB, device_total=80 * GiB, fraction=0.45)
    with pytest.raises(RequestError) as e:
        check_footprint(over)
    text = str(e.value)
    assert "\n" not in text and all(f in text for f in ("42.00 GiB", "41.00 GiB", "1.00 GiB", "0.45 x 80.00 GiB",
                                                        "36.00 GiB"))
    unmeasured = Footprint(torch_peak=37 * GiB, non_torch=None, device_total=80 * GiB, fraction=0.45)
    with pytest.raises(RequestError, match="unmeasured"):
        check_footprint(unmeasured)
    assert over.as_dict()["peak_gib"] == 42.0 and unmeasured.as_dict()["non_torch_gib"] is None


def test_nvml_usage_is_this_processs_entry_or_none():
    infos = [_ProcessInfo(pid=10, usedGpuMemory=5 * GiB), _ProcessInfo(pid=42, usedGpuMemory=3 * GiB)]
    assert own_usage(infos, 42) == 3 * GiB
    assert own_usage(infos, 7) is None  # not listed (a container's own process ids)
    assert own_usage([_ProcessInfo(pid=42, usedGpuMemory=NOT_AVAILABLE)], 42) is None


class Recording:
    """The target, recording each forward's token count, logits rows and what it captured."""

    def __init__(self, model):
        self.model, self.config, self.calls = model, model.config, []

    def __call__(self, batch, cache, capture="none", aux_layers=()):
        out = self.model(batch, cache, capture=capture, aux_layers=aux_layers)
        self.calls.append((batch.num_tokens, out.logits.shape[0], out.aux_hidden is not None))
        return out


@pytest.mark.parametrize("decodes", [True, False])
def test_the_profile_run_runs_a_full_chunk_and_the_largest_eager_and_graph_decode_steps(tiny_model_dir, decodes):
    """The forwards the reserve is measured on (their peaks are read on CUDA only: 0 here, NVML unread)."""
    from shared.memory.profile import profile_steps
    from shared.model.loader import load_target

    target = Recording(load_target(tiny_model_dir / "target", "float32", "cpu"))
    config = EngineConfig(page_size=4, max_running=40, chunk_size=96, cuda_graph=True, spec=SPEC, cuda_graph_max_bs=32,
                          dtype="float32")  # the target's (an engine resolves auto so; this calls the profile itself)
    peaks = profile_steps(target, config, max_context=256, capture="aux", aux_layers=(0, 1), decodes=decodes)
    width = SPEC.num_draft_tokens
    steps = [(96, 1, True)]  # the chunk: its last position's logits, the draft's features captured
    if decodes:  # the chunk beside a plain step's rows; every row of the largest eager step (max_running)
        # and of the largest captured one (cuda_graph_max_bs: 32)
        steps = [(96 + 40, 1 + 40, True), (40 * width, 40 * width, True), (32 * width, 32 * width, True)]
    assert target.calls == steps
    assert peaks == StepPeaks(prefill=0, decode=0, graph=0, non_torch=None)
    chunked_whole = profile_steps(target, EngineConfig(page_size=4, max_running=2, chunk_size=None, dtype="float32"),
                                  max_context=64,
                                  decodes=False)  # whole prompts: a step is one max_context prompt
    assert target.calls[-1] == (64, 1, False) and chunked_whole.non_torch is None
