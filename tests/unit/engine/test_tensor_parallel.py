"""Tensor parallelism over gloo (shared/parallel.py): a target split over two ranks gives what the whole
target gives.

Two ranks are spawned once for the module (``tp_ranks.suite``) and run every TP-2 workload; the TP-1
references run in this process, with the same functions. What is checked:

* the split model's logits equal the whole model's to float32 rounding (the ranks' partial sums are added
  in another order), on a target with biases on every projection, tied embeddings and a vocabulary of 509
  (not divisible by 2: the last rank's vocabulary shard is padded); each rank's pool holds half the KV heads;
* greedy output, token for token (logprobs to 1e-4), for the target alone and for EAGLE, EAGLE-3 and the
  multi-layer draft, chain and tree, page sizes 1 and 16, prompts cut into chunks; the same acceptance; pools
  free again; both ranks identical;
* sampled output with speculation (EAGLE chain, temperature + top-k + top-p) passes test_sampling_lossless's
  chi-square test against the exact law of the first four tokens, and the ranks draw the same tokens for
  requests that gave no seed (rank 0 chose it);
* a TP-2 prefill hands its requests off to a TP-1 decode engine (every KV head gathered on rank 0) and the
  decode engine generates the target's greedy output, for EAGLE-3 (page size 16) and the multi-layer draft
  (page size 1);
* and back: a TP-1 prefill hands off to a TP-2 decode engine (rank 0 receives every KV head, each rank keeps
  its own, checked exactly), which generates the target's greedy output (EAGLE tree page 16, multi-layer page 1);
* and into a TP-2 decode engine with its prefix cache on: a second prompt sharing the first's leading pages takes
  them on both ranks, the hand-off carries only the rest (wire format, and in place into the landing cache),
  output and K/V as without the cache, the ranks' caches alike, every pool full after a flush;
* engines built from checkpoint paths, each rank reading only its share of the target, give TP 1's greedy
  output for EAGLE and for an EAGLE-3 head that copies the target's whole LM head at load;
* under the adaptive policy (a timed choice each step: rank 0's) the ranks stay in step;
  and when rank 0 picks plain steps, the prefill chunks folded into them run alike on every rank;
* a rank whose step digest differs from rank 0's stops with an error naming the divergence;
* ``eyrie generate --tensor-parallel 2`` prints what TP 1 prints; a split the target's heads do not allow exits
  2 with one line, from ``generate`` and from ``serve`` (the services under tensor parallelism: tests/e2e).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file, save_file
from tp_ranks import (
    RANK_TIMEOUT_S,
    engine_outputs,
    forward_logits,
    handoff_cached_from_one_rank,
    path_outputs,
    run_group,
)

from services.cli import main
from shared.config import EngineConfig
from shared.engine import Engine
from shared.model.factory import make_tiny_target
from shared.model.loader import load_target
from shared.parallel import TPGroup, rank_device, vocab_shard
from shared.sampling import SamplingParams
from tests.oracle_model import make_oracle_model
from tests.unit.spec.test_sampling_lossless import P_MIN, VIEWS, chi_square_p, marginal, project
from tests.unit.spec.test_sampling_lossless import small_vocab as small_vocab  # noqa: F401 (a fixture)

PROMPTS = [[5, 6, 7, 8, 9], list(range(3, 33)), [7]]
GREEDY = [SamplingParams(max_new_tokens=10, ignore_eos=True)] * len(PROMPTS)
KINDS = (None, "eagle", "eagle3", "mtp")
CASES = [(kind, shape, page_size, 8) for kind in KINDS for shape in ("chain", "tree") for page_size in (1, 16)
         if kind is not None or shape == "chain"]  # chunks of 8 cut the two longer prompts
ADAPTIVE = [("eagle", "tree", 16, 8)]  # under the adaptive policy, whose timed choice is rank 0's
HANDOFFS = (("eagle3", 16), ("mtp", 1))  # draft kind, page size of a TP-2 prefill -> TP-1 decode hand-off
HANDBACKS = (("eagle", 16), ("mtp", 1))  # the same, TP-1 prefill -> TP-2 decode (a tree of 6 nodes)
# TP-1 prefill -> TP-2 decode with its prefix cache on (draft kind, topk, transport), page size 4: the second
# prompt shares the first's 22 leading tokens (5 whole pages and 2 tokens) and diverges inside page 5
CACHED_PAGE = 4
SHARED = [(i * 29 + 3) % 500 for i in range(22)]
CACHED_PROMPTS = [SHARED + [7, 8, 9, 10, 11], SHARED + [40, 41, 42]]
CACHED = (("eagle3", 1, "wire"), ("eagle3", 4, "ipc"))
# shape, setting (test_sampling_lossless.SETTINGS), requests, batch: 600 draws reject a split that changes the
# law (test_sampling_lossless draws 3000 per setting to prove the law itself; here p > 0.1 on every view)
SAMPLED = ("chain", "all", 600, 600)


@pytest.fixture(scope="module")
def odd_target(tmp_path_factory):
    """A tiny target with a bias on every projection, tied embeddings and 509 tokens."""
    out = make_tiny_target(tmp_path_factory.mktemp("odd"), seed=3, vocab_size=509, tie_word_embeddings=True,
                           attention_bias=True, mlp_bias=True)
    state = load_file(out / "model.safetensors")
    g = torch.Generator().manual_seed(4)
    for name in [k for k in state if k.endswith("_proj.weight")]:
        state[name.replace(".weight", ".bias")] = 0.1 * torch.randn(state[name].shape[0], generator=g)
    save_file(state, out / "model.safetensors")
    return out


@pytest.fixture(scope="module")
def oracle_root(tmp_path_factory):
    return make_oracle_model(tmp_path_factory.mktemp("tp-oracle"), seed=0, alpha=0.05)


@pytest.fixture(scope="module")
def path_drafts(oracle_root, tmp_path_factory) -> dict[str, str]:
    """Draft directories for engines built from paths: EAGLE (the target's LM head at run time) and the oracle's
    EAGLE-3 head without an LM head of its own (SGLang: no draft_vocab_size), which copies the target's at load."""
    out = tmp_path_factory.mktemp("borrowing") / "eagle3"
    shutil.copytree(oracle_root / "eagle3", out)
    state = load_file(out / "model.safetensors")
    del state["lm_head.weight"]
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    del cfg["draft_vocab_size"]
    (out / "config.json").write_text(json.dumps(cfg))
    return {"eagle": str(oracle_root / "eagle"), "eagle3 borrowing": str(out)}


@pytest.fixture(scope="module")
def tp2(odd_target, oracle_root, small_vocab, path_drafts):
    """Every TP-2 workload, run once on two gloo ranks: each rank's results."""
    jobs = {"logits": ("forward_logits", (str(odd_target), PROMPTS)),
            "greedy": ("engine_outputs", (str(oracle_root), CASES, PROMPTS, GREEDY)),
            "sampled": ("sampled_outputs", (str(small_vocab[0]), *SAMPLED)),
            "adaptive": ("engine_outputs", (str(oracle_root), ADAPTIVE, PROMPTS, GREEDY, "cpu", False, "adaptive")),
            "folded": ("folded_prefills", (str(oracle_root), PROMPTS, GREEDY[0])),
            "paths": ("path_outputs", (str(oracle_root / "target"), path_drafts, PROMPTS, GREEDY[0])),
            **{f"handoff {kind}": ("handoff_to_one_rank", (str(oracle_root), kind, page_size, PROMPTS, GREEDY[0]))
               for kind, page_size in HANDOFFS},
            **{f"handback {kind}": ("handoff_from_one_rank", (str(oracle_root), kind, page_size, PROMPTS, GREEDY[0]))
               for kind, page_size in HANDBACKS},
            **{f"cached {kind} {topk} {transport}": (
                "handoff_cached_from_one_rank", (str(oracle_root), kind, topk, transport, CACHED_PAGE, CACHED_PROMPTS,
                                                 GREEDY[0])) for kind, topk, transport in CACHED}}
    from tp_ranks import suite

    t0 = time.perf_counter()
    ranks = run_group(2, suite, jobs)
    print(f"TP-2 ranks: {time.perf_counter() - t0:.1f} s in all, jobs {ranks[0]['seconds']}")
    return ranks


@pytest.fixture(scope="module")
def target_tokens(oracle_root) -> list[list[int]]:
    """The whole target's greedy output for PROMPTS, on one rank without a draft: what every TP-2 run gives."""
    engine = Engine(oracle_root / "target", None, EngineConfig(page_size=1, chunk_size=None))
    return [r.token_ids for r in engine.generate(PROMPTS, GREEDY[0])]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/unit/engine/conftest.py


def test_split_logits_equal_the_whole_model_and_each_rank_holds_half_the_kv_heads(tp2, odd_target):
    want = forward_logits(None, str(odd_target), PROMPTS)
    assert want["logits"].shape == (sum(map(len, PROMPTS)), 509)
    for rank in tp2:
        got = rank["logits"]
        assert got["logits"].shape == want["logits"].shape
        torch.testing.assert_close(got["logits"], want["logits"], rtol=0, atol=1e-4)
        assert got["kv_heads"] * 2 == want["kv_heads"] == 2
    assert torch.equal(tp2[0]["logits"]["logits"], tp2[1]["logits"]["logits"])  # the same gathered logits


def test_tp2_greedy_output_equals_tp1_for_every_draft_kind_tree_and_page_size(tp2, oracle_root):
    want = engine_outputs(None, str(oracle_root), CASES, PROMPTS, GREEDY)
    for case in CASES:
        ref = want[case]
        for r, rank in enumerate(tp2):
            got = rank["greedy"][case]
            assert got["tokens"] == ref["tokens"], f"{case} rank {r}: {got['tokens']} != {ref['tokens']}"
            assert torch.allclose(torch.tensor(got["logprobs"]), torch.tensor(ref["logprobs"]), atol=1e-4), case
            assert got["finish"] == ref["finish"] and got["accept_length"] == ref["accept_length"], case
            assert got["clean"] and ref["clean"], f"{case} rank {r}: pages or request slots left allocated"
            assert got["kv_heads"] * 2 == ref["kv_heads"]
    # The oracle drafts are really accepted, so accepted runs were compacted in the split pools too.
    assert all(max(want[c]["accept_length"]) > 1.4 for c in CASES if c[0] is not None)


def test_engines_loading_their_share_from_the_checkpoint_give_tp1s_greedy_output(tp2, oracle_root, path_drafts,
                                                                                  target_tokens):
    """Built from paths, each rank reads its share of the target (``load_target_shard``); a draft that borrows the
    target's LM head at run time (EAGLE) or copies it at load (EAGLE-3 without its own: the whole head read from
    the checkpoint) gives TP 1's tokens and acceptance."""
    want = path_outputs(None, str(oracle_root / "target"), path_drafts, PROMPTS, GREEDY[0])
    whole_head = load_target(oracle_root / "target").lm_head.weight
    assert torch.equal(want["eagle3 borrowing"]["lm_head"], whole_head)
    for name, ref in want.items():
        assert ref["tokens"] == target_tokens and max(ref["accept_length"]) > 1.4, name
        for r, rank in enumerate(tp2):
            got = rank["paths"][name]
            assert got["split"] and not ref["split"]
            assert got["tokens"] == ref["tokens"] and got["accept_length"] == ref["accept_length"], f"{name} rank {r}"
            assert got["clean"], f"{name} rank {r}: pages or request slots left allocated"
            if ref["lm_head"] is not None:
                assert torch.equal(got["lm_head"], whole_head), f"{name} rank {r}: not the whole LM head"


def test_ranks_follow_rank_0s_timed_choice_under_the_adaptive_policy(tp2, target_tokens):
    """Each rank times its own steps, so only rank 0's choice between a speculative and a plain step can
    keep them in step: both finish with the target's greedy output."""
    for rank in tp2:
        got = rank["adaptive"][ADAPTIVE[0]]
        assert got["tokens"] == target_tokens and got["clean"]


def test_ranks_fold_prefill_chunks_into_rank_0s_plain_steps_alike(tp2, target_tokens):
    """Rank 0 picks plain steps (speculation made dear); rank 1, timing its own, follows: the later prefill chunks
    run in the decode steps' one target forward on both, and both give the target's greedy output."""
    a, b = tp2[0]["folded"], tp2[1]["folded"]
    assert a["tokens"] == b["tokens"] == target_tokens and a["clean"] and b["clean"]
    assert a["choices"]["spec"] == 0 and len(a["mixed"]) >= 2 and a["mixed"] == b["mixed"]
    assert a["forwards"] == b["forwards"] == [1] * len(a["forwards"])


def test_tp2_sampled_speculation_keeps_the_target_distribution(tp2, small_vocab):
    _, laws = small_vocab
    shape, setting, n, _ = SAMPLED
    rows = tp2[0]["sampled"]
    assert rows["tokens"] == tp2[1]["sampled"]["tokens"] and rows["clean"]
    observed = Counter(tuple(t) for t in rows["tokens"])
    assert sum(observed.values()) == n
    pvalues = {view: chi_square_p(project(observed, pos), marginal(laws[setting], pos)) for view, pos in VIEWS.items()}
    print(f"TP-2 {shape} {setting}: chi-square p " + ", ".join(f"{v} {p:.3g}" for v, p in pvalues.items()))
    view = min(pvalues, key=pvalues.get)
    assert pvalues[view] * len(VIEWS) > P_MIN, f"{view}: chi-square p = {pvalues[view]:.2e}"
    assert sum(rows["accepted"]) > n / 4, "the speculative path was hardly taken"


def test_ranks_draw_the_seed_rank_0_chose_for_unseeded_requests(tp2):
    a, b = tp2[0]["sampled"]["unseeded"], tp2[1]["sampled"]["unseeded"]
    assert len(a) == 4 and a == b


def test_a_rank_that_diverges_from_rank_0_stops_with_an_error(tp2):
    assert tp2[0]["diverged"] is None
    assert "differs from rank 0's" in tp2[1]["diverged"] and "rank 1" in tp2[1]["diverged"]


@pytest.mark.parametrize("kind", [kind for kind, _ in HANDOFFS])
def test_a_tp2_prefill_hands_off_to_a_tp1_decode_losslessly(tp2, target_tokens, kind):
    """Rank 0 gathers both ranks' KV heads of each parked request and sends them through the wire format to a
    TP-1 decode engine, which resumes from the draft state and generates the target's greedy output."""
    got = tp2[0][f"handoff {kind}"]
    assert tp2[1][f"handoff {kind}"] is None
    assert got["tokens"] == target_tokens
    assert got["clean"], "pages or request slots left allocated on the prefill or the decode engine"


@pytest.mark.parametrize("kind", [kind for kind, _ in HANDBACKS])
def test_a_tp1_prefill_hands_off_to_a_tp2_decode_losslessly(tp2, target_tokens, kind):
    """Rank 0 of a TP-2 decode engine receives every KV head through the wire format; each rank keeps exactly
    its heads of the target's K/V and the whole draft K/V, and both generate the target's greedy output."""
    for r, rank in enumerate(tp2):
        got = rank[f"handback {kind}"]
        assert got["same_kv"] == [True] * len(PROMPTS), f"rank {r}: K/V not what the prefill engine computed"
        assert got["tokens"] == target_tokens, f"rank {r}"
        assert got["clean"], f"rank {r}: pages or request slots left allocated"


@pytest.mark.parametrize("kind,topk,transport", CACHED, ids=[f"{k}-topk{t}-{tr}" for k, t, tr in CACHED])
def test_a_tp2_decode_with_a_prefix_cache_takes_the_pages_it_holds(tp2, oracle_root, kind, topk, transport):
    """Issue 33 under tensor parallelism: a TP-2 decode engine's prefix cache holds the same pages under the same
    ids on every rank (every rank runs the same reservations and activations), so the second hand-off's reservation
    takes the 5 shared pages on both ranks, rank 0's sink says so, the sender skips them (over the wire format, or
    in place into rank 0's landing cache) and each rank scatters only its heads of the 2 pages that arrive. The
    output is the single-process engine's, each rank's K/V at every position (held ones too) is its heads of what
    the TP-1 prefill computed, and after the cache's flush every pool of both ranks is full."""
    engine = Engine(oracle_root / "target", None, EngineConfig(page_size=1, chunk_size=None))
    want = [r.token_ids for r in engine.generate(CACHED_PROMPTS, GREEDY[0])]
    got = [rank[f"cached {kind} {topk} {transport}"] for rank in tp2]
    one = handoff_cached_from_one_rank(None, str(oracle_root), kind, topk, transport, CACHED_PAGE, CACHED_PROMPTS,
                                       GREEDY[0])  # the same into a TP-1 decode engine
    assert [(q["tokens"], q["held"], q["sent"]) for q in one["requests"]] == [
        (q["tokens"], q["held"], q["sent"]) for q in got[0]["requests"]]
    assert one["cached"] == got[0]["cached"] and one["clean"], "TP 1 cached other pages"
    assert all(q["same_kv"] for q in one["requests"])
    pages = [-(-len(p) // CACHED_PAGE) for p in CACHED_PROMPTS]
    for r, rank in enumerate(got):
        first, second = rank["requests"]
        assert [q["tokens"] for q in rank["requests"]] == want, f"rank {r}"
        assert [q["same_kv"] for q in rank["requests"]] == [True, True], f"rank {r}: K/V not the prefill's"
        assert (first["held"], second["held"]) == (0, len(SHARED) // CACHED_PAGE), f"rank {r}"
        assert rank["referenced"] == 0 and rank["flushed"] == 0 and rank["clean"], f"rank {r}: pages kept"
    first, second = got[0]["requests"]
    assert (first["sink_held"], second["sink_held"]) == (0, len(SHARED) // CACHED_PAGE)
    # every page carries as many bytes: the first hand-off sent all its pages, the second only those not held
    assert second["sent"] * pages[0] == first["sent"] * (pages[1] - second["held"]) and second["sent"] > 0
    assert got[0]["cached"] == got[1]["cached"] and len(got[0]["cached"]) >= len(SHARED) // CACHED_PAGE, (
        "the ranks' prefix caches differ")


# ---- the command line --------------------------------------------------------------------------------
def eyrie_at_once(*commands: list[str]) -> list[subprocess.CompletedProcess]:
    """Each ``eyrie`` command line run to its end, all started at once (their start-ups overlap)."""
    procs = [subprocess.Popen([sys.executable, "-m", "services.cli", *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for args in commands]
    try:
        outputs = [p.communicate(timeout=RANK_TIMEOUT_S) for p in procs]
        return [subprocess.CompletedProcess(p.args, p.returncode, out, err) for p, (out, err) in zip(procs, outputs)]
    finally:
        for p in procs:
            if p.poll() is None:  # timed out: stop the rest too
                p.kill()


def test_generate_tensor_parallel_2_prints_what_tp_1_prints(tiny_model_dir):
    common = ["generate", "--model", str(tiny_model_dir / "target"), "--draft", str(tiny_model_dir / "eagle"),
              "--prompt-ids", "5,6,7,8", "--prompt-ids", "40,41", "--max-new-tokens", "6", "--ignore-eos",
              "--page-size", "1", "--json"]
    one, two = eyrie_at_once(common, [*common, "--tensor-parallel", "2"])
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    tokens = [[json.loads(line)["token_ids"] for line in p.stdout.splitlines()] for p in (one, two)]
    assert tokens[0] == tokens[1] and [len(t) for t in tokens[0]] == [6, 6]


@pytest.mark.parametrize("command, flags, says", [
    (["generate"], ["--tensor-parallel", "3", "--prompt-ids", "5"],
     "tensor_parallel=3 does not divide the target's num_attention_heads (4)"),
    (["generate"], ["--tensor-parallel", "0", "--prompt-ids", "5"], "tensor_parallel"),
    (["serve", "decode"], ["--tensor-parallel", "3"],
     "tensor_parallel=3 does not divide the target's num_attention_heads (4)"),
    (["serve", "prefill"], ["--tensor-parallel", "3"],
     "tensor_parallel=3 does not divide the target's num_attention_heads (4)"),
])
def test_a_split_that_cannot_run_exits_2_with_one_line(tiny_model_dir, capsys, command, flags, says):
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--model", str(tiny_model_dir / "target"), *flags])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and says in err and len(err.strip().splitlines()) == 1, err


# ---- the pieces, in this process ---------------------------------------------------------------------
def fake_group(rank: int, size: int) -> TPGroup:
    return TPGroup(rank=rank, size=size, group=None, control=None)  # enough for the arithmetic of splits


def test_vocabulary_shards_cover_every_id_once_and_pad_the_last_rank():
    table = torch.arange(7 * 3, dtype=torch.float32).view(7, 3)
    parts = [vocab_shard(table, fake_group(r, 3)) for r in range(3)]
    assert [start for _, start in parts] == [0, 3, 6]
    assert all(part.shape == (3, 3) for part, _ in parts)
    assert torch.equal(torch.cat([part for part, _ in parts])[:7], table)
    assert not parts[2][0][1:].any()  # the padding rows: logits of 0, cut off after the gather


def test_each_rank_takes_its_own_gpu_and_the_cpu_stays_shared():
    assert [rank_device("cuda", r) for r in range(2)] == ["cuda:0", "cuda:1"]
    assert rank_device("cuda:2", 1) == "cuda:3" and rank_device("cpu", 1) == "cpu"


def test_an_engine_refuses_tensor_parallel_without_its_group(tiny_model_dir):
    with pytest.raises(ValueError, match="tensor_parallel=2 needs a group of that many ranks"):
        Engine(tiny_model_dir / "target", config=EngineConfig(tensor_parallel=2))
