"""FP8 checkpoints on the CPU: compressed-tensors (per-channel or per-tensor weight scales, dynamic activations)
and the block-wise ``fp8`` format load into FP8 projections whose product is the dequantized weight's; a
loaded FP8 target computes exactly what its dequantized twin (a plain checkpoint of ``fp8 * scale``) does;
speculation with an unquantized head beside it is lossless; ``eyrie make-model --fp8`` writes both formats;
what cannot be loaded is refused naming the field or tensor. (The CUDA products: tests/gpu/test_fp8_gpu.py.)"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.model import fp8
from shared.model.config import CheckpointError
from shared.model.factory import fp8_quantization_config, make_model, quantize_checkpoint, write_checkpoint
from shared.model.loader import load_target
from shared.model.shard_loader import load_target_shard
from shared.parallel import TPGroup
from shared.sampling import SamplingParams
from tests.oracle_model import make_oracle_model

ROOT = Path(__file__).resolve().parents[3]
GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [11, 3, 200, 17, 17, 9], [42]]


@pytest.fixture(scope="module", params=["channel", "block"])
def fp8_pair(request, tmp_path_factory) -> tuple[str, Path]:
    """The tiny random target as an FP8 checkpoint of each format, with its (unquantized) draft heads."""
    out = tmp_path_factory.mktemp(f"fp8-{request.param}")
    make_model("tiny", out, fp8=request.param)
    return request.param, out


def dequantized_twin(fp8_dir: Path, out: Path) -> Path:
    """A plain float32 checkpoint of the FP8 one's weights as they compute: ``fp8 * scale``."""
    cfg = json.loads((fp8_dir / "config.json").read_text())
    fmt = fp8.fp8_format(cfg)
    state = load_file(str(fp8_dir / "model.safetensors"))
    quantized = fp8.split_state(state, fmt)
    for module, (scale, block) in quantized.items():
        state[f"{module}.weight"] = fp8.dequantize(fp8.mark(state[f"{module}.weight"], scale, block))
    del cfg["quantization_config"]
    write_checkpoint(out, cfg, state)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(fp8_dir / name, out / name)
    return out


# ---- formats --------------------------------------------------------------------------------------
def test_formats_are_read_from_the_config_and_what_cannot_run_is_refused_by_field():
    assert fp8.fp8_format({}) is None
    assert fp8.fp8_format({"quantization_config": fp8_quantization_config("channel")}) == \
        fp8.Fp8Format("channel", None, ("lm_head",))
    assert fp8.fp8_format({"quantization_config": fp8_quantization_config("block", [128, 128])}).block == (128, 128)
    tensor = fp8_quantization_config("channel")
    tensor["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"
    assert fp8.fp8_format({"quantization_config": tensor}).kind == "channel"

    def refused(q: dict, field: str) -> None:
        with pytest.raises(CheckpointError, match=f"quantization_config.{field}"):
            fp8.fp8_format({"quantization_config": q})

    refused({"quant_method": "awq"}, "quant_method")
    refused({**fp8_quantization_config("block"), "fmt": "e5m2"}, "fmt")
    refused({**fp8_quantization_config("block"), "activation_scheme": "static"}, "activation_scheme")
    refused({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size")
    static = fp8_quantization_config("channel")
    static["config_groups"]["group_0"]["input_activations"]["dynamic"] = False
    refused(static, "config_groups.group_0.input_activations")
    int8 = fp8_quantization_config("channel")
    int8["config_groups"]["group_0"]["weights"]["type"] = "int"
    refused(int8, "config_groups.group_0.weights")
    grouped = fp8_quantization_config("channel")
    grouped["config_groups"]["group_0"]["weights"]["strategy"] = "group"
    refused(grouped, "config_groups.group_0.weights.strategy")


@pytest.mark.parametrize("kind, block", [("channel", None), ("block", (128, 128)), ("block", (16, 32)),
                                         ("block", (5, 7))])
def test_quantize_keeps_each_block_within_fp8_and_dequantizes_close(kind, block):
    torch.manual_seed(0)
    w = torch.randn(40, 96) * torch.linspace(0.1, 3.0, 96)  # columns of different ranges
    q, scale = fp8.quantize(w, kind, block or (128, 128))
    bn, bk = (1, 96) if kind == "channel" else block
    assert q.dtype == fp8.FP8 and q.shape == w.shape
    assert scale.shape == (-(-40 // bn), -(-96 // bk)) and scale.dtype == torch.float32
    back = fp8.dequantize(fp8.mark(q, scale, (bn, bk)))
    assert ((back - w).norm() / w.norm()).item() < 0.04  # e4m3: 3 mantissa bits
    # each block's largest magnitude lands on FP8's largest value
    tiles = q.float().abs().reshape(-(-40 // bn), bn, -1, bk) if kind == "channel" or 96 % bk == 0 and 40 % bn == 0 \
        else None
    if tiles is not None:
        assert torch.all(tiles.amax(dim=(1, 3)) == fp8.FP8_MAX)


def test_fused_projections_concatenate_their_scales_aligned_or_not():
    torch.manual_seed(1)
    for block, rows in (((16, 32), (32, 16, 16)), ((16, 32), (24, 8, 8)), ((1, 64), (24, 8, 8))):
        ws = [torch.randn(n, 64) for n in rows]
        parts = [fp8.mark(*fp8.quantize(w, "block", block), block) for w in ws]
        fused = fp8.cat_weights(parts)
        assert fused.dtype == fp8.FP8 and fused.shape == (sum(rows), 64)
        assert torch.equal(fp8.dequantize(fused), torch.cat([fp8.dequantize(p) for p in parts]))
    assert fused.fp8_block == (1, 64)


# ---- loading --------------------------------------------------------------------------------------
def test_make_model_writes_the_public_layouts(fp8_pair):
    kind, out = fp8_pair
    cfg = json.loads((out / "target" / "config.json").read_text())
    assert cfg["quantization_config"] == fp8_quantization_config(kind)
    scale = "weight_scale" if kind == "channel" else "weight_scale_inv"
    with safe_open(str(out / "target" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        q = f.get_tensor("model.layers.0.mlp.down_proj.weight")
        s = f.get_tensor(f"model.layers.0.mlp.down_proj.{scale}")
        assert f.get_tensor("lm_head.weight").dtype == torch.float32  # the head and norms stay
        assert f.get_tensor("model.layers.0.input_layernorm.weight").dtype == torch.float32
    assert q.dtype == fp8.FP8 and s.dtype == torch.float32
    assert s.shape == ((q.shape[0], 1) if kind == "channel" else (1, 2))  # 64 x 160 in 128 x 128 blocks
    assert sum(n.endswith(scale) for n in names) == 7 * 4  # every projection of the 4 layers
    with safe_open(str(out / "eagle3" / "model.safetensors"), "pt") as f:
        assert all(f.get_tensor(n).dtype != fp8.FP8 for n in f.keys())  # noqa: SIM118
    assert "quantization_config" not in json.loads((out / "eagle3" / "config.json").read_text())


def test_a_loaded_fp8_target_computes_what_its_dequantized_twin_does(fp8_pair, tmp_path):
    kind, out = fp8_pair
    model = load_target(out / "target")
    weights = fp8.fp8_weights_of(model)
    assert len(weights) == 4 * 4  # fused qkv, o, gate_up, down of 4 layers
    assert all(w.dtype == fp8.FP8 for w in weights)
    twin = dequantized_twin(out / "target", tmp_path / "twin")
    a, b = Engine(out / "target", config=EngineConfig()), Engine(twin, config=EngineConfig())
    for prompt in PROMPTS:
        assert a.generate(prompt, GREEDY)[0].token_ids == b.generate(prompt, GREEDY)[0].token_ids


def test_a_loaded_fp8_targets_lm_head_is_marked_for_the_same_product_at_every_row_count(fp8_pair):
    """The bf16 LM head of an FP8 target runs ``kernels.fp8_gemv.same_rows_linear`` on CUDA (a decode step's
    logits and a verify step's the same bits: tests/gpu/test_fp8_gpu.py); on the CPU the dense product."""
    _, out = fp8_pair
    model = load_target(out / "target")
    head = model.lm_head.weight
    assert getattr(head, "same_rows", False) and not fp8.is_fp8(head)
    assert not getattr(model.model.embed_tokens.weight, "same_rows", False) or model.config.tie_word_embeddings
    x = torch.randn(3, head.shape[1], dtype=head.dtype)
    torch.testing.assert_close(fp8.linear(x, head), torch.nn.functional.linear(x, head), rtol=0, atol=0)


@pytest.mark.parametrize("scale_layout", ["tensor_bf16", "channel_flat"])
def test_compressed_tensors_per_tensor_and_flat_scales_load(tmp_path, scale_layout):
    make_model("tiny", tmp_path, fp8="channel")
    target = tmp_path / "target"
    state = load_file(str(target / "model.safetensors"))
    for name in [n for n in state if n.endswith("weight_scale")]:
        q = state[name.replace("_scale", "")]
        weight = fp8.dequantize(fp8.mark(q, state[name], (1, q.shape[1])))
        if scale_layout == "tensor_bf16":  # one scale for the tensor, stored in bfloat16 as llm-compressor does
            s = (weight.abs().max() / fp8.FP8_MAX).to(torch.bfloat16)
            state[name.replace("_scale", "")] = (weight / s.float()).clamp(-448, 448).to(fp8.FP8)
            state[name] = s.reshape(1)
        else:
            state[name] = state[name].reshape(-1)
    save_file(state, str(target / "model.safetensors"))
    twin = dequantized_twin(target, tmp_path / "twin")
    a, b = Engine(target, config=EngineConfig()), Engine(twin, config=EngineConfig())
    assert a.generate(PROMPTS[0], GREEDY)[0].token_ids == b.generate(PROMPTS[0], GREEDY)[0].token_ids


def test_block_checkpoints_with_several_blocks_per_weight_load(tmp_path):
    make_model("tiny", tmp_path)
    quantize_checkpoint(tmp_path / "target", "block", [16, 32])
    model = load_target(tmp_path / "target")
    assert {w.fp8_block for w in fp8.fp8_weights_of(model)} == {(16, 32)}
    twin = dequantized_twin(tmp_path / "target", tmp_path / "twin")
    a, b = Engine(model, config=EngineConfig()), Engine(twin, config=EngineConfig())
    assert a.generate(PROMPTS[1], GREEDY)[0].token_ids == b.generate(PROMPTS[1], GREEDY)[0].token_ids


def rewrite(target: Path, edit) -> None:
    state = load_file(str(target / "model.safetensors"))
    edit(state)
    save_file(state, str(target / "model.safetensors"))


@pytest.mark.parametrize("problem, match", [
    ("no_scale", "model.layers.1.self_attn.k_proj.weight: an FP8 weight without its scale"),
    ("bad_block_shape", "model.layers.0.mlp.up_proj.weight_scale_inv: block scale shape"),
    ("static_input_scale", "model.layers.0.self_attn.q_proj.input_scale: static activation scales"),
    ("no_quantization_config", "FP8 weights, but config.json has no quantization_config"),
    ("fp8_norm", "model.norm.weight: FP8, but model.norm is not a projection"),
])
def test_bad_fp8_checkpoints_are_refused_naming_the_tensor(tmp_path, problem, match):
    make_model("tiny", tmp_path, fp8="block")
    target = tmp_path / "target"
    if problem == "no_scale":
        rewrite(target, lambda s: s.pop("model.layers.1.self_attn.k_proj.weight_scale_inv"))
    elif problem == "bad_block_shape":
        rewrite(target, lambda s: s.update({"model.layers.0.mlp.up_proj.weight_scale_inv": torch.ones(3, 1)}))
    elif problem == "static_input_scale":
        rewrite(target, lambda s: s.update({"model.layers.0.self_attn.q_proj.input_scale": torch.ones(1)}))
    elif problem == "no_quantization_config":
        cfg = json.loads((target / "config.json").read_text())
        del cfg["quantization_config"]
        (target / "config.json").write_text(json.dumps(cfg))
    else:
        rewrite(target, lambda s: s.update({"model.norm.weight": s["model.norm.weight"].to(fp8.FP8),
                                            "model.norm.weight_scale_inv": torch.ones(1, 1)}))
    with pytest.raises(CheckpointError, match=match):
        load_target(target)


def test_make_model_cli_writes_fp8_and_refuses_an_unknown_format(tmp_path):
    cmd = [sys.executable, "-m", "services.cli", "make-model", str(tmp_path / "m"), "--fp8", "block"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    cfg = json.loads((tmp_path / "m" / "target" / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "fp8"
    bad = subprocess.run([*cmd[:-1], "int4"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert bad.returncode == 2 and "--fp8: invalid choice: 'int4'" in bad.stderr
    gen = subprocess.run([sys.executable, "-m", "services.cli", "generate", "--model", str(tmp_path / "m" / "target"),
                          "--draft", str(tmp_path / "m" / "eagle3"), "--prompt-ids", "5,6,7", "--max-new-tokens",
                          "6", "--ignore-eos", "--json"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert gen.returncode == 0, gen.stderr
    want = Engine(tmp_path / "m" / "target", config=EngineConfig()).generate([5, 6, 7], SamplingParams(
        max_new_tokens=6, ignore_eos=True))[0].token_ids
    assert json.loads(gen.stdout)["token_ids"] == want


# ---- speculation against an FP8 target ---------------------------------------------------------------
@pytest.fixture(scope="module", params=["channel", "block"])
def fp8_oracle(request, tmp_path_factory) -> Path:
    """Oracle drafts (accepted often) beside their target quantized to FP8: the heads stay float32."""
    root = make_oracle_model(tmp_path_factory.mktemp(f"fp8-oracle-{request.param}"), seed=3)
    quantize_checkpoint(root / "target", request.param, [16, 32] if request.param == "block" else [128, 128])
    return root


@pytest.mark.parametrize("head, topk, steps, ndt", [("eagle3", 2, 3, 6), ("eagle", 1, 3, 4)])
def test_speculation_against_an_fp8_target_is_greedy_lossless(fp8_oracle, head, topk, steps, ndt):
    plain = Engine(fp8_oracle / "target", config=EngineConfig(page_size=4, chunk_size=8))
    spec = Engine(fp8_oracle / "target", draft=fp8_oracle / head,
                  config=EngineConfig(page_size=4, chunk_size=8, spec_policy="fixed",
                                      spec=SpecConfig(topk=topk, steps=steps, num_draft_tokens=ndt)))
    want = [r.token_ids for r in plain.generate(PROMPTS, GREEDY)]
    got = spec.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in got] == want
    assert spec.spec_stats.totals.accept_length > 1.5  # the drafts were really accepted, not only verified
    assert spec.is_idle_and_clean() and plain.is_idle_and_clean()


@pytest.mark.parametrize("kind, block", [("channel", [128, 128]), ("block", [16, 16])])
def test_each_tensor_parallel_rank_loads_its_share_of_the_fp8_weights_and_scales(tmp_path, kind, block):
    """Rank r of 2 reads its rows (q/k/v, gate/up) or columns (o, down) of each FP8 weight with the scales
    covering them: dequantized, exactly the share the dense twin's rank r holds."""
    make_model("tiny", tmp_path)
    quantize_checkpoint(tmp_path / "target", kind, block)
    twin = dequantized_twin(tmp_path / "target", tmp_path / "twin")
    for rank in (0, 1):
        tp = TPGroup(rank=rank, size=2, group=None, control=None)  # loading needs no collective
        shard, dense = load_target_shard(tmp_path / "target", tp), load_target_shard(twin, tp)
        for mine, theirs in zip(shard.model.layers, dense.model.layers):
            for a, b in ((mine.self_attn.qkv_weight, theirs.self_attn.qkv_weight),
                         (mine.self_attn.o_proj.weight, theirs.self_attn.o_proj.weight),
                         (mine.mlp.gate_up_weight, theirs.mlp.gate_up_weight),
                         (mine.mlp.down_proj.weight, theirs.mlp.down_proj.weight)):
                assert a.dtype == fp8.FP8 and torch.equal(fp8.dequantize(a), b)


def test_a_split_that_cuts_a_scale_block_is_refused_by_name(tmp_path):
    make_model("tiny", tmp_path)
    quantize_checkpoint(tmp_path / "target", "block", [48, 32])  # q has 64 rows: rank 1's 32 start inside a block
    with pytest.raises(CheckpointError, match="q_proj.weight: rank 1's share starts at 32, inside a scale block"):
        load_target_shard(tmp_path / "target", TPGroup(rank=1, size=2, group=None, control=None))


def test_an_fp8_target_split_over_two_ranks_generates_what_one_does(tmp_path):
    """``eyrie generate --tensor-parallel 2`` (two gloo ranks) on an FP8 checkpoint of 16 x 16 blocks: the greedy
    tokens of one rank."""
    make_model("tiny", tmp_path)
    quantize_checkpoint(tmp_path / "target", "block", [16, 16])
    want = Engine(tmp_path / "target", config=EngineConfig()).generate(PROMPTS[1], GREEDY)[0].token_ids
    ids = ",".join(map(str, PROMPTS[1]))
    done = subprocess.run([sys.executable, "-m", "services.cli", "generate", "--model", str(tmp_path / "target"),
                           "--tensor-parallel", "2", "--prompt-ids", ids, "--max-new-tokens", "24", "--ignore-eos",
                           "--json"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["token_ids"] == want
