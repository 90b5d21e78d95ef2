"""On the GPU: greedy output with CUDA graphs == without graphs == the CPU reference.

For every draft kind, topk 1 and > 1, page sizes 1 and 16, and a batch that does not fill its graph
bucket (so padding rows are replayed). Runs in float32 so the CPU reference is comparable token
for token.
"""

import pytest
import torch

from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.sampling import SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 33, 2, 9, 100, 200, 7], list(range(40, 77)), [3] * 5]
PARAMS = SamplingParams(max_new_tokens=24, ignore_eos=True)


def _run(model_dir, draft, device, graphs, spec=None, page_size=16):
    cfg = EngineConfig(device=device, dtype="float32", page_size=page_size, chunk_size=8, spec=spec,
                       cuda_graph=graphs)
    engine = Engine(model_dir / "target", None if draft is None else model_dir / draft, cfg)
    results = engine.generate(PROMPTS, PARAMS)
    assert engine.is_idle_and_clean()
    return [r.token_ids for r in results], [r.spec_stats for r in results]


@pytest.fixture(scope="module")
def cpu_reference(oracle_model_dir):
    return _run(oracle_model_dir, None, "cpu", False)[0]


def test_target_decode_graph_equals_eager_and_cpu(oracle_model_dir, cpu_reference):
    eager, _ = _run(oracle_model_dir, None, "cuda", False)
    graph, _ = _run(oracle_model_dir, None, "cuda", True)
    assert graph == eager == cpu_reference


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "mtp"])
@pytest.mark.parametrize("topk,steps,n", [(1, 3, 4), (4, 5, 16)])
@pytest.mark.parametrize("page_size", [1, 16])
def test_spec_graph_equals_eager_and_cpu(oracle_model_dir, cpu_reference, kind, topk, steps, n, page_size):
    spec = SpecConfig(topk=topk, steps=steps, num_draft_tokens=n)
    eager, _ = _run(oracle_model_dir, kind, "cuda", False, spec, page_size)
    graph, stats = _run(oracle_model_dir, kind, "cuda", True, spec, page_size)
    assert graph == eager == cpu_reference
    assert max(s["accept_length"] for s in stats) > 1.5  # drafts were accepted under the graphs


def test_graph_capture_mutates_no_request_state(oracle_model_dir):
    """Capturing happens on padding rows only: a request's K/V is the same before and after."""
    cfg = EngineConfig(device="cuda", dtype="float32", page_size=16, chunk_size=None, cuda_graph=True,
                       spec=SpecConfig(topk=2, steps=3, num_draft_tokens=6))
    engine = Engine(oracle_model_dir / "target", oracle_model_dir / "eagle", cfg)
    req = engine.add_request(PROMPTS[1], PARAMS)
    engine.step()  # prefill only: no decode graph captured yet
    slots = engine.cache.slots(req.handles[0], 0, req.kv_len)
    before = [k[slots].clone() for k in engine.cache.k]
    for g in engine.speculator.graphs.values():
        assert not g._graphs
    w = engine.speculator
    w._reserve([req])
    inp = w._inputs([req])
    w.graphs["draft"]._capture((inp,))
    after = [k[slots] for k in engine.cache.k]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    engine.abort(req.rid)
    assert engine.is_idle_and_clean()


@pytest.mark.parametrize("kind", [None, "eagle3"])
def test_graphs_captured_ahead_of_serving(oracle_model_dir, cpu_reference, kind):
    """capture_graphs() records every enabled phase at every bucket before any request, on padding
    rows only; serving afterwards replays them and gives the CPU reference's tokens."""
    spec = None if kind is None else SpecConfig(topk=2, steps=3, num_draft_tokens=6)
    cfg = EngineConfig(device="cuda", dtype="float32", page_size=16, chunk_size=8, spec=spec, cuda_graph=True,
                       cuda_graph_max_bs=8, spec_policy="fixed")  # one shape: its phases' graphs are the speculator's
    engine = Engine(oracle_model_dir / "target", None if kind is None else oracle_model_dir / kind, cfg)
    count = engine.capture_graphs()
    graphs = [engine.decode_graphs] if kind is None else list(engine.speculator.graphs.values())
    assert count == sum(len(g.buckets) for g in graphs) > 0
    assert all(g.captured_sizes == g.buckets for g in graphs)
    assert engine.is_idle_and_clean()  # nothing allocated to a request by the capture
    got = [r.token_ids for r in engine.generate(PROMPTS, PARAMS)]
    assert got == cpu_reference
    assert engine.is_idle_and_clean()


@pytest.mark.parametrize("kind,topk,steps,n", [("eagle", 1, 3, 4), ("eagle3", 2, 3, 8), ("mtp", 2, 3, 8)])
@pytest.mark.parametrize("page_size", [1, 16])
def test_drafting_ahead_under_graphs_equals_the_cpu(oracle_model_dir, kind, topk, steps, n, page_size):
    """The draft launched ahead (on by default on CUDA) while requests end at different steps (the
    others' rows of it are used, the ended ones' become padding) and one joins mid-way (foreseen: no
    draft is launched ahead for a batch about to grow): tokens equal the CPU's without it, the
    page-size-1 host mirror of the target's request-to-token map equals the device table after every
    step, and every pool ends full."""
    max_new = [24, 5, 13]
    join_prompt, join_after = [11, 12, 13, 14], 6

    def run(device, ahead):
        cfg = EngineConfig(device=device, dtype="float32", page_size=page_size, chunk_size=8,
                           cuda_graph=device == "cuda", spec=SpecConfig(topk=topk, steps=steps, num_draft_tokens=n),
                           spec_draft_ahead=ahead,
                           spec_policy="fixed")  # every step speculative: the draft ahead is used and cut
        engine = Engine(oracle_model_dir / "target", oracle_model_dir / kind, cfg)
        reqs = [engine.add_request(p, SamplingParams(max_new_tokens=m, ignore_eos=True))
                for p, m in zip(PROMPTS, max_new)]
        table, step = engine.cache.req_to_token, 0
        while engine.scheduler.has_work() or step <= join_after:
            if step == join_after:
                reqs.append(engine.add_request(join_prompt, SamplingParams(max_new_tokens=9, ignore_eos=True)))
            engine.step()
            step += 1
            for r in engine.scheduler.running:
                assert torch.equal(table.host[r.handles[0].row], table.table[r.handles[0].row].cpu())
        assert engine.is_idle_and_clean()
        return [engine.result(r).token_ids for r in reqs], engine.speculator

    want, _ = run("cpu", False)
    got, w = run("cuda", None)
    assert w.ahead.enabled and w.ahead.used > 0 and w.ahead.partial > 0 and w.ahead.mismatched == 0
    assert got == want
    off, w = run("cuda", False)
    assert off == want and w.ahead.used == 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU")
def test_an_engine_on_the_second_gpu_stepped_from_another_thread(oracle_model_dir, cpu_reference):
    """An engine on cuda:1 with graphs and drafting ahead, stepped from a fresh thread (current device
    0): Triton launches, graph capture and the event guarding the tokens' copy all land on cuda:1."""
    import threading

    out = {}

    def run():
        cfg = EngineConfig(device="cuda:1", dtype="float32", page_size=16, chunk_size=8, cuda_graph=True,
                           spec=SpecConfig(topk=1, steps=3, num_draft_tokens=4))
        engine = Engine(oracle_model_dir / "target", oracle_model_dir / "eagle", cfg)
        engine.capture_graphs()
        out["tokens"] = [r.token_ids for r in engine.generate(PROMPTS, PARAMS)]
        out["clean"] = engine.is_idle_and_clean()

    t = threading.Thread(target=run)
    t.start()
    t.join(300)
    assert out.get("tokens") == cpu_reference and out["clean"]
