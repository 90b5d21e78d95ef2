"""Train the house target: a Llama-family model from scratch on the Python sources of installed packages.

    python -m bench.house.train_target --out /tmp/house            # the GPU run (~5 min of training, H100, bf16)
    python -m bench.house.train_target --out /tmp/house-tiny --tiny  # seconds on the CPU (what the test runs)

Corpus: the ``.py`` files of named packages importable in the running Python, in a fixed order
(packages as listed, files sorted by path within each); whole packages are held out for evaluation.
The packages found, their distributions and versions, file and byte counts are in the output; the
ones not installed are listed as missing. Tokenizer: a byte-level BPE trained on the training split
with the ``tokenizers`` library (``--bpe-vocab`` ids, BOS and EOS first), the model's vocabulary
padded to ``--vocab-size`` (Llama-3's 128256) with reserved special tokens, which training teaches to
stay unlikely (they are in every softmax and never a label), so that widening to Llama-3.1-8B's shape
is exact. Model: Llama-3.1's architecture (head_dim 128, GQA, llama3 rope) at a small width.

The output directory is a Hugging Face checkpoint the engine loads (``config.json``,
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``), plus ``house.json`` (packages,
settings, the loss curve with wall time, held-out loss and perplexity, greedy samples from the engine)
and ``corpus/{train,heldout}.jsonl`` (the documents, for ``eyrie train-draft --corpus``).
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import importlib.util
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from shared.model.config import ModelConfig
from shared.model.factory import llama_hf_config, write_checkpoint
from shared.training.dense import causal_lm_loss, new_llama

# Llama-3.1's rotary embedding (what the widened model's config says, as Llama-3.1-8B's does).
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
TRAIN_PACKAGES = ("torch", "transformers", "sympy", "scipy", "numpy", "networkx", "pip", "setuptools", "pygments",
                  "openai", "huggingface_hub", "mpmath", "redis", "triton", "pydantic", "hypothesis", "_pytest",
                  "google.protobuf", "fsspec", "grpc", "jinja2", "anyio", "urllib3", "httpx")
HELDOUT_PACKAGES = ("requests", "click", "packaging", "idna", "yaml", "filelock", "tqdm")
# The chat template written with the tokenizer: turns as Python comments ("# user: ..."), the assistant's
# reply as plain code ended by EOS, so a chat prompt reads as a commented Python file to a model trained on
# Python; ``chat_documents`` puts chats in this format into the training corpus.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}{{ '# assistant:\\n' + m['content'] + eos_token + '\\n' }}"
    "{% else %}{{ '# ' + m['role'] + ': ' + m['content'] | replace('\\n', '\\n# ') }}{{ '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '# assistant:\\n' }}{% endif %}"
)
CHAT_ASK = "Continue this Python module:\n"  # a chat document's question, before the module's opening lines
CHAT_EVERY = 4  # every this many training documents, one more as a chat (0 = no chats)
SAMPLE_PROMPTS = ("def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main(",
                  "class Config:\n    def __init__(self, ", "    for i in range(len(")


@dataclass
class HouseConfig:
    out: str
    train_packages: tuple[str, ...] = TRAIN_PACKAGES
    heldout_packages: tuple[str, ...] = HELDOUT_PACKAGES
    max_package_bytes: int | None = None  # cap per package (files in order until the cap)
    bpe_vocab: int = 32000
    vocab_size: int = 128256
    tokenizer_sample_bytes: int = 64_000_000  # the BPE is trained on the first this many bytes
    hidden_size: int = 1024
    intermediate_size: int = 3584
    num_hidden_layers: int = 8
    num_attention_heads: int = 8  # head_dim 128, as Llama-3.1-8B's
    num_key_value_heads: int = 2
    max_position_embeddings: int = 131072  # Llama-3.1's (what widening keeps)
    seq_len: int = 1024
    batch: int = 16  # windows per step
    steps: int = 3000  # the schedule's length; the time budget may stop (and decay) it sooner
    time_budget_s: float | None = 300.0
    lr: float = 1.5e-3
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 200
    eval_windows: int = 64
    log_every: int = 10
    sample_tokens: int = 48
    chat_every: int = CHAT_EVERY  # every this many training documents, one more as a chat (0 = none)
    seed: int = 0
    device: str = "cuda"
    dtype: str = "bfloat16"  # autocast dtype on CUDA; the saved checkpoint's dtype
    extra: dict = field(default_factory=dict)


TINY = dict(train_packages=("json", "email"), heldout_packages=("http",), max_package_bytes=60_000, bpe_vocab=384,
            vocab_size=1024, tokenizer_sample_bytes=200_000, hidden_size=128, intermediate_size=256,
            num_hidden_layers=2, num_attention_heads=1, num_key_value_heads=1, seq_len=64, batch=8, steps=40,
            time_budget_s=None, lr=3e-3, warmup=5, eval_every=20, eval_windows=4, log_every=5, sample_tokens=12,
            device="cpu", dtype="float32")


# ---- corpus ---------------------------------------------------------------------------------------
@dataclass
class Package:
    name: str  # import name
    distribution: str | None
    version: str | None
    split: str  # "train" or "heldout"
    files: int = 0
    bytes: int = 0


def package_sources(name: str) -> list[Path]:
    """The package's ``.py`` files, sorted by path (a module: its one file); [] when not importable."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    if spec.submodule_search_locations:
        return sorted(p for loc in spec.submodule_search_locations for p in Path(loc).rglob("*.py"))
    return [Path(spec.origin)] if spec.origin and spec.origin.endswith(".py") else []


@functools.lru_cache(maxsize=1)
def installed_distributions() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def distribution_of(name: str) -> tuple[str | None, str | None]:
    top = name.split(".")[0]
    dists = installed_distributions().get(top) or []
    if not dists:
        return None, None  # the standard library, or a module without metadata
    return dists[0], importlib.metadata.version(dists[0])


def read_package(name: str, split: str, cap: int | None) -> tuple[Package, list[str]]:
    dist, version = distribution_of(name)
    pkg, texts = Package(name, dist, version, split), []
    for path in package_sources(name):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        if cap is not None and pkg.bytes + len(text) > cap and texts:
            break
        texts.append(text)
        pkg.files += 1
        pkg.bytes += len(text)
    return pkg, texts


def assemble_corpus(cfg: HouseConfig) -> tuple[list[str], list[str], list[Package], list[str]]:
    """(training documents, held-out documents, the packages read, the names not installed)."""
    train, held, packages, missing = [], [], [], []
    for split, names in (("train", cfg.train_packages), ("heldout", cfg.heldout_packages)):
        for name in names:
            pkg, texts = read_package(name, split, cfg.max_package_bytes)
            if not texts:
                missing.append(name)
                continue
            packages.append(pkg)
            (train if split == "train" else held).extend(texts)
    if not train or not held:
        raise SystemExit(f"house: no {'training' if not train else 'held-out'} package is installed "
                         f"(looked for {list(cfg.train_packages if not train else cfg.heldout_packages)})")
    return train, held, packages, missing


def chat_documents(texts: list[str], every: int = CHAT_EVERY, ask_lines: int = 12,
                   answer_chars: int = 4000) -> list[list[dict]]:
    """Chats made of every ``every``-th document: the user asks to continue a module and gives its first
    ``ask_lines`` lines, the assistant answers with what follows (up to ``answer_chars``, whole lines)."""
    chats = []
    for text in texts[::every] if every else []:
        lines = text.splitlines(keepends=True)
        if len(lines) <= ask_lines:
            continue
        answer = "".join(lines[ask_lines:])
        cut = answer.rfind("\n", 0, answer_chars)
        answer = answer if len(answer) <= answer_chars else answer[:cut + 1 if cut >= 0 else answer_chars]
        chats.append([{"role": "user", "content": CHAT_ASK + "".join(lines[:ask_lines]).rstrip("\n")},
                      {"role": "assistant", "content": answer.rstrip("\n")}])
    return chats


def chat_renderer(model_dir: Path):
    """Whole conversations rendered with the chat template written in ``model_dir`` (as the router renders
    prompts, and ``eyrie train-draft`` its chat records)."""
    from services.router.openai_http import ChatTemplate

    template = ChatTemplate(model_dir)
    return lambda messages: template.render(messages, add_generation_prompt=False)


# ---- tokenizer ------------------------------------------------------------------------------------
def train_tokenizer(texts: list[str], cfg: HouseConfig):
    """Byte-level BPE of ``bpe_vocab`` ids (BOS, EOS first), not yet padded."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    sample, total = [], 0
    for t in texts:
        if total >= cfg.tokenizer_sample_bytes:
            break
        sample.append(t)
        total += len(t)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=cfg.bpe_vocab, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(sample, trainer=trainer)
    return tok


def pad_vocabulary(tok, vocab_size: int) -> int:
    """Reserve every id from the BPE's size to ``vocab_size`` as a special token; returns how many."""
    n = vocab_size - tok.get_vocab_size()
    if n < 0:
        raise SystemExit(f"house: the BPE has {tok.get_vocab_size()} ids, more than --vocab-size {vocab_size}")
    tok.add_special_tokens([f"<|reserved_special_token_{i}|>" for i in range(n)])
    assert tok.get_vocab_size() == vocab_size
    return n


def token_stream(tok, texts: list[str], eos: int) -> torch.Tensor:
    ids = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int64)


# ---- model and training ---------------------------------------------------------------------------
def model_config(cfg: HouseConfig) -> dict:
    return llama_hf_config(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                           intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
                           num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                           max_position_embeddings=cfg.max_position_embeddings, rope_theta=500000.0,
                           rope_scaling=LLAMA31_ROPE, rms_norm_eps=1e-5)


def learning_rate(cfg: HouseConfig, step: int, progress: float) -> float:
    """Warm-up, then cosine decay to a tenth over ``progress`` (the larger of step and time fractions)."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def windows_at(stream: torch.Tensor, starts: torch.Tensor, seq_len: int) -> torch.Tensor:
    return stream[starts.unsqueeze(1) + torch.arange(seq_len + 1)]


@torch.no_grad()
def heldout_loss(model, held: torch.Tensor, cfg: HouseConfig, autocast) -> float:
    n = min(cfg.eval_windows, (held.numel() - 1) // (cfg.seq_len + 1))
    starts = torch.arange(n) * (cfg.seq_len + 1)
    wins = windows_at(held, starts, cfg.seq_len).to(model.lm_head.weight.device)
    losses = []
    for i in range(0, n, cfg.batch):
        with autocast():
            losses.append(float(causal_lm_loss(model, wins[i:i + cfg.batch])) * wins[i:i + cfg.batch].shape[0])
    return sum(losses) / n


def train(cfg: HouseConfig, model, stream: torch.Tensor, held: torch.Tensor, log) -> dict:
    dev = model.lm_head.weight.device
    on_cuda_half = dev.type == "cuda" and cfg.dtype != "float32"

    def autocast():
        return torch.autocast("cuda", dtype=getattr(torch, cfg.dtype), enabled=on_cuda_half)
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    keep = [p for n, p in model.named_parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay}, {"params": keep, "weight_decay": 0}],
                            lr=cfg.lr, betas=(0.9, 0.95), fused=dev.type == "cuda")
    gen = torch.Generator().manual_seed(cfg.seed)
    curve, evals = [], []
    t0 = time.perf_counter()
    step, tokens = 0, 0
    while step < cfg.steps:
        elapsed = time.perf_counter() - t0
        if cfg.time_budget_s is not None and elapsed >= cfg.time_budget_s:
            break
        progress = max(step / cfg.steps, elapsed / cfg.time_budget_s if cfg.time_budget_s else 0.0)
        for g in opt.param_groups:
            g["lr"] = learning_rate(cfg, step, progress)
        starts = torch.randint(0, stream.numel() - cfg.seq_len - 1, (cfg.batch,), generator=gen)
        ids = windows_at(stream, starts, cfg.seq_len).to(dev, non_blocking=True)
        with autocast():
            loss = causal_lm_loss(model, ids)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        tokens += ids.numel() - cfg.batch
        if step % cfg.log_every == 0 or step == 1:
            curve.append({"step": step, "seconds": round(time.perf_counter() - t0, 2),
                          "loss": round(float(loss.detach()), 4), "lr": round(opt.param_groups[0]["lr"], 7)})
            log(f"house: step {step} loss {curve[-1]['loss']:.4f} ({curve[-1]['seconds']:.0f} s)")
        if step % cfg.eval_every == 0:
            evals.append({"step": step, "heldout_loss": round(heldout_loss(model, held, cfg, autocast), 4)})
    seconds = time.perf_counter() - t0
    final = heldout_loss(model, held, cfg, autocast)
    if not evals or evals[-1]["step"] != step:
        evals.append({"step": step, "heldout_loss": round(final, 4)})
    return {"steps": step, "tokens": tokens, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / max(seconds, 1e-9), 1), "loss_curve": curve, "evals": evals,
            "heldout_loss": round(final, 4), "heldout_perplexity": round(math.exp(final), 3)}


# ---- writing --------------------------------------------------------------------------------------
def write_tokenizer(out: Path, tok, max_length: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": BOS, "eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_length, "chat_template": CHAT_TEMPLATE}, indent=1))


def write_house(out: Path, cfg: HouseConfig, hf_cfg: dict, model) -> None:
    dtype = getattr(torch, cfg.dtype)
    state = {k: v.detach().to("cpu", dtype) for k, v in model.state_dict().items()}
    write_checkpoint(out, {**hf_cfg, "torch_dtype": cfg.dtype}, state)


def write_documents(path: Path, texts: list[str], chats: list[list[dict]] = ()) -> None:
    """JSONL for ``eyrie train-draft --corpus``: the texts, then the chats as ``messages`` records."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
        for messages in chats:
            f.write(json.dumps({"messages": messages}) + "\n")


def greedy_samples(out: Path, cfg: HouseConfig) -> list[dict]:
    """Greedy continuations of a few prompts, by the engine from the written checkpoint."""
    from shared.config import EngineConfig
    from shared.engine import Engine
    from shared.sampling import SamplingParams

    engine = Engine(out, config=EngineConfig(device=cfg.device, dtype=cfg.dtype, max_running=len(SAMPLE_PROMPTS),
                                             max_context=256, chunk_size=None))
    results = engine.generate(list(SAMPLE_PROMPTS), SamplingParams(max_new_tokens=cfg.sample_tokens))
    return [{"prompt": p, "completion": r.text, "token_ids": r.token_ids} for p, r in zip(SAMPLE_PROMPTS, results)]


def build_house(cfg: HouseConfig, log=lambda line: print(line, file=sys.stderr)) -> dict:
    out = Path(cfg.out)
    t0 = time.perf_counter()
    train_texts, held_texts, packages, missing = assemble_corpus(cfg)
    log(f"house: {len(train_texts)} training and {len(held_texts)} held-out files from {len(packages)} packages")
    tok = train_tokenizer(train_texts, cfg)
    eos = tok.token_to_id(EOS)
    reserved = pad_vocabulary(tok, cfg.vocab_size)
    hf_cfg = model_config(cfg)
    write_tokenizer(out, tok, hf_cfg["max_position_embeddings"])
    chats = chat_documents(train_texts, cfg.chat_every)
    render = chat_renderer(out)
    stream = token_stream(tok, train_texts + [render(m) for m in chats], eos)
    held = token_stream(tok, held_texts, eos)
    prep_s = time.perf_counter() - t0
    torch.manual_seed(cfg.seed)
    model = new_llama(ModelConfig.from_hf_dict(hf_cfg), torch.device(cfg.device))
    params = sum(p.numel() for p in model.parameters())
    log(f"house: {params / 1e6:.1f}M parameters, {stream.numel()} training tokens; training")
    result = train(cfg, model, stream, held, log)
    write_house(out, cfg, hf_cfg, model)
    write_documents(out / "corpus" / "train.jsonl", train_texts, chats)
    write_documents(out / "corpus" / "heldout.jsonl", held_texts)
    summary = {
        "out": str(out), "device": torch.cuda.get_device_name() if cfg.device.startswith("cuda") else cfg.device,
        "python": sys.version.split()[0], "torch": torch.__version__,
        "packages": [asdict(p) for p in packages], "missing_packages": missing,
        "chats": len(chats),
        "tokenizer": {"bpe_vocab": cfg.bpe_vocab, "vocab_size": cfg.vocab_size, "reserved": reserved,
                      "train_tokens": stream.numel(), "heldout_tokens": held.numel()},
        "model": {k: hf_cfg[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                         "num_attention_heads", "num_key_value_heads", "head_dim")},
        "parameters": params, "prepare_seconds": round(prep_s, 2), "train": result,
        "samples": greedy_samples(out, cfg), "settings": asdict(cfg),
    }
    (out / "house.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tiny", action="store_true", help="a CPU-sized run of seconds (stdlib packages, 2 layers)")
    p.add_argument("--train-packages", nargs="+")
    p.add_argument("--heldout-packages", nargs="+")
    for name, kind in (("steps", int), ("time_budget_s", float), ("batch", int), ("seq_len", int), ("lr", float),
                       ("device", str), ("dtype", str), ("seed", int), ("max_package_bytes", int),
                       ("num_hidden_layers", int)):
        p.add_argument("--" + name.replace("_", "-"), type=kind)
    args = p.parse_args(argv)
    fields = {**(TINY if args.tiny else {})}
    for k, v in vars(args).items():
        if k not in ("out", "tiny") and v is not None:
            fields[k] = tuple(v) if isinstance(v, list) else v
    summary = build_house(HouseConfig(out=args.out, **fields))
    print(json.dumps({k: summary[k] for k in ("out", "device", "packages", "missing_packages", "tokenizer", "model",
                                              "parameters", "samples")} | {
        "train": {k: v for k, v in summary["train"].items() if k != "loss_curve"}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
