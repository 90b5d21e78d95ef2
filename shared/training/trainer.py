"""``eyrie train-draft``: train an EAGLE-3, EAGLE or multi-layer draft head for a target, online.

The target runs in the same process and produces each batch's features and labels
(``targets.TargetRunner``); the head learns the unrolled multi-step objective (``unroll``). Every
``eval_every`` steps the head is written to ``out`` in its public format and measured: the engine's
speculative decoding on held-out prompts (``evaluate``), and the objective on held-out windows.

``out`` is the head's directory (``config.json``, ``model.safetensors``: load it with
``--draft out``); ``out/train_state/`` holds what resuming needs: ``data.pt`` (the token windows,
the held-out stream, the draft vocabulary, fixed when training starts) and ``state.pt`` (the
head's float32 weights, the optimiser, the step, the log). A run resumed from a checkpoint takes
the same batches in the same order and ends with the same weights as one that was never stopped:
batches are a function of (seed, step), the learning rate a function of the step.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from shared.model.drafts import DRAFT_ARCHITECTURES, DraftHead
from shared.model.llama import LlamaForCausalLM
from shared.model.loader import load_target, parse_dtype
from shared.model.tokenizer import Tokenizer
from shared.training.corpus import (
    ChatRenderer,
    CorpusError,
    draft_vocabulary,
    read_documents,
    sample_split,
    vocab_coverage,
    vocab_maps,
    windows,
)
from shared.training.evaluate import heldout_prompts, measure_acceptance
from shared.training.heads import head_config, new_head, write_head
from shared.training.targets import TargetRunner
from shared.training.unroll import chain_estimate, unrolled_objective

KINDS = ("eagle3", "eagle", "mtp")
STATE_DIR = "train_state"


class TrainError(ValueError):
    """A run that cannot start: bad settings, a target that is not one, a checkpoint of another run."""


@dataclass
class TrainConfig:
    target: str
    corpus: list[str]
    out: str
    kind: str = "eagle3"
    steps: int = 1000
    lr: float = 3e-4
    batch_tokens: int = 8192
    seq_len: int = 512
    ttt_steps: int = 7  # unrolled steps (a multi-layer draft gets one layer per step)
    eval_every: int = 200  # 0: evaluate only at the start and the end
    save_every: int | None = None  # None: with every evaluation
    resume: bool = False
    device: str = "cpu"
    dtype: str = "float32"  # the target's (and the written head's) dtype; the head trains in float32
    draft_vocab: int | None = None  # EAGLE-3: None = min(32000, target vocabulary)
    seed: int = 0
    heldout: float = 0.05  # fraction of documents held out
    warmup: int = 50
    grad_clip: float = 0.5
    eval_prompts: int = 8
    eval_prompt_len: int = 32
    eval_new_tokens: int = 32
    eval_spec_steps: int | None = None  # chain depth of the acceptance measurement (None: min(ttt_steps, 5))
    eval_windows: int = 4  # held-out windows the objective is measured on
    regenerate: int = 0  # the last tokens of every training window replaced by the target's greedy continuation
    max_windows: int | None = None  # train on at most this many windows (a seeded choice): bounds --regenerate
    log_every: int = 10
    progress: bool = True
    time_budget_s: float | None = None  # stop (evaluate and save) once training has run this long

    def check(self) -> None:
        if self.kind not in KINDS:
            raise TrainError(f"--kind: {self.kind!r} is not one of {', '.join(KINDS)}")
        for name in ("steps", "batch_tokens", "ttt_steps", "eval_prompts", "eval_prompt_len", "eval_new_tokens",
                     "eval_windows", "log_every"):
            if getattr(self, name) < 1:
                raise TrainError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(self, name)}")
        if self.seq_len < self.ttt_steps + 2:
            raise TrainError(f"--seq-len: {self.seq_len} leaves no anchor for --ttt-steps {self.ttt_steps} "
                             f"(needs at least ttt-steps + 2)")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise TrainError(f"--lr: must be a positive number, got {self.lr}")
        if not 0 < self.heldout < 1:
            raise TrainError(f"--heldout: must be in (0, 1), got {self.heldout}")
        if self.eval_every < 0:
            raise TrainError(f"--eval-every: must be >= 0, got {self.eval_every}")
        if self.time_budget_s is not None and not self.time_budget_s > 0:
            raise TrainError(f"--time-budget-s: must be > 0, got {self.time_budget_s}")
        if self.max_windows is not None and self.max_windows < 1:
            raise TrainError(f"--max-windows: must be >= 1, got {self.max_windows}")
        if not 0 <= self.regenerate < self.seq_len:
            raise TrainError(f"--regenerate: must be in [0, --seq-len {self.seq_len}), got {self.regenerate}")
        if self.kind == "mtp" and self.spec_steps > self.ttt_steps:
            raise TrainError(f"--eval-spec-steps: {self.spec_steps} draft steps need as many layers, and the "
                             f"multi-layer draft gets one per --ttt-steps ({self.ttt_steps})")
        parse_dtype(self.dtype)

    @property
    def rows(self) -> int:
        """Windows per batch."""
        return max(1, self.batch_tokens // self.seq_len)

    @property
    def spec_steps(self) -> int:
        return self.eval_spec_steps or min(self.ttt_steps, 5)


@dataclass
class Data:
    """What training reads, fixed when it starts (saved for resuming)."""

    windows: torch.Tensor  # [n, seq_len] int64 training windows
    heldout: torch.Tensor  # [M] int64 held-out token stream
    hot: torch.Tensor | None  # [Vd] int64 EAGLE-3 draft vocabulary (ascending target ids), None otherwise
    info: dict = field(default_factory=dict)  # documents and tokens per split


# ---- the target -----------------------------------------------------------------------------------
def load_checked_target(cfg: TrainConfig) -> tuple[LlamaForCausalLM, dict]:
    path = Path(cfg.target)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise TrainError(f"--target: {path} is not a checkpoint directory (no config.json)")
    hf = json.loads(cfg_file.read_text())
    archs = hf.get("architectures") or []
    if any(a in DRAFT_ARCHITECTURES for a in archs):
        raise TrainError(f"--target: {path} is a draft head ({archs[0]}), not a target model")
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise TrainError("--device: cuda was asked for but no CUDA device is available")
    target = load_target(path, cfg.dtype, cfg.device)
    target.requires_grad_(False)
    return target, hf


def target_fingerprint(target: LlamaForCausalLM) -> dict:
    """The target's shape and a digest of its embedding: what a checkpoint must have been trained on."""
    c = target.config
    rows = target.model.embed_tokens.weight[:64].detach().float().cpu().contiguous()
    return {"vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "num_hidden_layers": c.num_hidden_layers,
            "embed_digest": hashlib.sha256(rows.numpy().tobytes()).hexdigest()[:16]}


# ---- data -----------------------------------------------------------------------------------------
VOCAB_TOKENS_PER_ID = 128  # the draft vocabulary is counted on at least this many training tokens per draft id
HELDOUT_SPREAD = 32  # held-out tokens tokenized per token the evaluation reads (its prompts from many documents)


class Phases:
    """Wall seconds per named phase of a run (load, read, tokenize, ..., train), summed over its entries."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def as_dict(self) -> dict[str, float]:
        return {f"{k}_s": round(v, 2) for k, v in self.seconds.items()}


def token_budgets(cfg: TrainConfig, draft_vocab: int | None) -> tuple[int | None, int | None]:
    """Tokens of the (training, held-out) split to tokenize: with ``--max-windows``, what the windows
    and the draft vocabulary's counts need, and the held-out stream the evaluation reads times
    ``HELDOUT_SPREAD``; without it, the whole corpus (None)."""
    if cfg.max_windows is None:
        return None, None
    train = max(cfg.max_windows * cfg.seq_len, VOCAB_TOKENS_PER_ID * (draft_vocab or 0))
    heldout = HELDOUT_SPREAD * max(cfg.eval_windows * cfg.seq_len, cfg.eval_prompts * cfg.eval_prompt_len)
    return train, heldout


def prepare_data(cfg: TrainConfig, target: LlamaForCausalLM, render_chat: ChatRenderer | None,
                 phases: Phases | None = None) -> Data:
    phases = phases or Phases()
    tok_dir = Path(cfg.target)
    if not (tok_dir / "tokenizer.json").exists():
        raise TrainError(f"--target: {tok_dir} has no tokenizer.json, so the corpus cannot be tokenized")
    tokenizer = Tokenizer(tok_dir)
    V = target.config.vocab_size
    vd = None
    if cfg.kind == "eagle3":
        vd = cfg.draft_vocab or min(32000, V)
        if not 1 <= vd <= V:
            raise TrainError(f"--draft-vocab: {vd} is outside [1, {V}] (the target's vocabulary)")
    with phases("read"):
        docs = read_documents(cfg.corpus, render_chat)
    if len(docs) == 1:
        print(f"train-draft: one document: its last {cfg.heldout:.0%} of tokens are held out", file=sys.stderr)
    eos = target.config.eos_token_ids[0] if target.config.eos_token_ids else None
    train_budget, heldout_budget = token_budgets(cfg, vd)
    with phases("tokenize"):
        split = sample_split(docs, tokenizer.encode_batch, eos, V, cfg.heldout, train_budget, heldout_budget,
                             cfg.seed)
    if split.heldout.numel() < 2:
        raise CorpusError(f"corpus: the held-out split has {split.heldout.numel()} tokens; give more text")
    info = {"corpus_docs": len(docs), "train_docs": split.train_docs, "heldout_docs": split.heldout_docs,
            "train_tokens": split.train.numel(), "heldout_tokens": split.heldout.numel()}
    hot = None
    if vd is not None:
        with phases("vocab"):
            hot = draft_vocabulary(split.train, V, vd)
            info["draft_vocab_heldout_coverage"] = round(vocab_coverage(hot, split.heldout, V), 4)
    with phases("windows"):
        wins = windows(split.train, cfg.seq_len)
        if cfg.max_windows is not None and wins.shape[0] > cfg.max_windows:
            keep = torch.randperm(wins.shape[0], generator=torch.Generator().manual_seed(cfg.seed))[:cfg.max_windows]
            wins = wins[keep.sort().values]
    if cfg.regenerate:
        with phases("regenerate"):
            wins = regenerate(target, wins, cfg.regenerate, cfg)
    return Data(windows=wins, heldout=split.heldout, hot=hot, info=info)


# Windows regenerated together. On CUDA the decode step is one captured graph of this batch size: the
# step's device work at 512 rows of a small target is well under the host's bookkeeping per step, so fewer,
# wider steps (512 rows x 128 tokens: 128 steps per batch) are what makes it fast.
REGENERATE_BATCH = {"cpu": 64, "cuda": 512}


def regenerate(target: LlamaForCausalLM, wins: torch.Tensor, n: int, cfg: TrainConfig) -> torch.Tensor:
    """``wins`` with each window's last ``n`` tokens replaced by the target's greedy continuation of
    the tokens before them (what the head will be asked to predict when serving, greedy)."""
    from shared.config import EngineConfig
    from shared.engine import Engine
    from shared.sampling import SamplingParams

    T = wins.shape[1]
    rows = min(REGENERATE_BATCH[target.lm_head.weight.device.type], wins.shape[0])
    config = EngineConfig(device=cfg.device, dtype=cfg.dtype, max_running=rows, max_context=T + 1, chunk_size=None,
                          cuda_graph=True, cuda_graph_phases=("decode",), cuda_graph_max_bs=rows)
    engine = Engine(target, config=config)
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    out = wins.clone()
    for start in range(0, wins.shape[0], rows):
        prompts = wins[start:start + rows, :T - n].tolist()
        results = engine.generate(prompts, params)
        out[start:start + len(prompts), T - n:] = torch.tensor([r.token_ids for r in results])
    return out


@functools.lru_cache(maxsize=4)
def epoch_order(seed: int, epoch: int, n_windows: int) -> torch.Tensor:
    return torch.randperm(n_windows, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


def batch_windows(cfg: TrainConfig, n_windows: int, step: int) -> torch.Tensor:
    """Indices of step ``step``'s windows: epochs of seeded permutations, a function of (seed, step)."""
    first = step * cfg.rows
    picks = [int(epoch_order(cfg.seed, k // n_windows, n_windows)[k % n_windows])
             for k in range(first, first + cfg.rows)]
    return torch.tensor(picks, dtype=torch.int64)


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    warm = min(cfg.warmup, cfg.steps // 10)
    if step < warm:
        return cfg.lr * (step + 1) / warm
    frac = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


# ---- the run --------------------------------------------------------------------------------------
class Progress:
    """A tqdm bar on stderr when tqdm is installed, plain lines otherwise."""

    def __init__(self, cfg: TrainConfig, start: int):
        self.bar = None
        self.every = cfg.log_every
        if cfg.progress:
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self.bar = tqdm(total=cfg.steps, initial=start, file=sys.stderr, desc="train-draft", unit="step")
        self.enabled = cfg.progress

    def step(self, step: int, loss: float, acc0: float) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.3f}", acc0=f"{acc0:.2f}", refresh=False)
        elif self.enabled and (step + 1) % self.every == 0:
            print(f"train-draft: step {step + 1} loss {loss:.4f} acc0 {acc0:.3f}", file=sys.stderr)

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        elif self.enabled:
            print(line, file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Trainer:
    def __init__(self, cfg: TrainConfig, render_chat: ChatRenderer | None = None):
        cfg.check()
        self.cfg = cfg
        self.out = Path(cfg.out)
        self.state_dir = self.out / STATE_DIR
        self.phases = Phases()  # wall seconds of load, data preparation, training and evaluation
        with self.phases("load"):
            self.target, self.target_hf = load_checked_target(cfg)
        self.device = self.target.lm_head.weight.device
        self.fingerprint = target_fingerprint(self.target)
        saved = self._load_state() if cfg.resume else None
        if saved is not None:
            with self.phases("read_saved_data"):
                self.data = self._load_data()
        else:
            self.data = prepare_data(cfg, self.target, render_chat, self.phases)
        num_layers = cfg.ttt_steps if cfg.kind == "mtp" else 1
        vd = None if self.data.hot is None else self.data.hot.numel()
        self.head_cfg = head_config(cfg.kind, self.target_hf, num_layers, vd)
        torch.manual_seed(cfg.seed)
        self.head: DraftHead = new_head(cfg.kind, self.head_cfg, self.target, self.device)
        self.t2d = None
        if self.data.hot is not None:
            d2t, self.t2d = vocab_maps(self.data.hot, self.target.config.vocab_size)
            self.head.d2t.copy_(d2t)
        self.params = [p for p in self.head.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        self.step = 0
        self.log: list[dict] = []
        if saved is not None:
            self.head.load_state_dict(saved["head"])
            self.opt.load_state_dict(saved["optimizer"])
            self.step, self.log = saved["step"], saved["log"]
        capture = "aux" if cfg.kind == "eagle3" else "last"
        aux = getattr(self.head, "aux_layers", ())
        self.runner = TargetRunner(self.target, capture, aux, cfg.rows, cfg.seq_len, self.data.hot)
        self.eval_runner = None

    # ---- resuming ------------------------------------------------------------------------------
    def _settings(self) -> dict:
        """The settings a resumed run must share with the one it continues."""
        c = self.cfg
        return {"kind": c.kind, "corpus": [str(p) for p in c.corpus], "seq_len": c.seq_len, "ttt_steps": c.ttt_steps,
                "batch_tokens": c.batch_tokens, "draft_vocab": c.draft_vocab, "seed": c.seed, "heldout": c.heldout,
                "lr": c.lr, "warmup": c.warmup, "regenerate": c.regenerate, "max_windows": c.max_windows,
                "steps": c.steps}

    def _load_state(self) -> dict | None:
        file = self.state_dir / "state.pt"
        if not file.exists():
            raise TrainError(f"--resume: {file} does not exist (no checkpoint of an earlier run in --out)")
        saved = torch.load(file, map_location="cpu", weights_only=False)
        if saved["target"] != self.fingerprint:
            want = {k: v for k, v in saved["target"].items() if k != "embed_digest"}
            raise TrainError(f"--resume: the checkpoint in {self.out} was trained for another target "
                             f"({want}, embedding digest {saved['target']['embed_digest']}), not {self.cfg.target} "
                             f"(embedding digest {self.fingerprint['embed_digest']})")
        theirs, ours = saved["settings"], self._settings()
        diff = [k for k in ours if k != "steps" and theirs.get(k) != ours[k]]
        if diff:
            k = diff[0]
            raise TrainError(f"--resume: the checkpoint was trained with {k}={theirs.get(k)!r}, this run has "
                             f"{k}={ours[k]!r}")
        return saved

    def _load_data(self) -> Data:
        d = torch.load(self.state_dir / "data.pt", map_location="cpu", weights_only=False)
        return Data(windows=d["windows"], heldout=d["heldout"], hot=d["hot"], info=d["info"])

    def save(self) -> None:
        """The head in its public format, then the training state (each file replaced atomically)."""
        with self.phases("save"):
            self._save()

    def _save(self) -> None:
        write_head(self.out, self.head_cfg, self.head, self.t2d, parse_dtype(self.cfg.dtype))
        self.state_dir.mkdir(parents=True, exist_ok=True)
        data = self.state_dir / "data.pt"
        if not data.exists():
            _atomic_save({"windows": self.data.windows, "heldout": self.data.heldout, "hot": self.data.hot,
                          "info": self.data.info}, data)
        _atomic_save({"head": self.head.state_dict(), "optimizer": self.opt.state_dict(), "step": self.step,
                      "log": self.log, "target": self.fingerprint, "settings": self._settings()},
                     self.state_dir / "state.pt")

    # ---- training --------------------------------------------------------------------------------
    def autocast(self):
        on_gpu_half = self.device.type == "cuda" and self.cfg.dtype != "float32"
        return torch.autocast("cuda", dtype=parse_dtype(self.cfg.dtype), enabled=on_gpu_half)

    def train_step(self) -> dict:
        cfg = self.cfg
        ids = self.data.windows[batch_windows(cfg, self.data.windows.shape[0], self.step)]
        batch = self.runner(ids)
        for g in self.opt.param_groups:
            g["lr"] = learning_rate(cfg, self.step)
        with self.autocast():
            obj = unrolled_objective(self.head, batch, cfg.ttt_steps)
        self.opt.zero_grad(set_to_none=True)
        obj.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)
        self.opt.step()
        self.step += 1
        return {"step": self.step, "loss": float(obj.loss.detach()), "accuracy": [round(a, 4) for a in obj.accuracy()],
                "grad_norm": round(float(grad_norm), 4), "lr": learning_rate(cfg, self.step - 1)}

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Write the head, measure its acceptance in the engine and its objective on held-out text."""
        t0 = time.perf_counter()
        cfg = self.cfg
        write_head(self.out, self.head_cfg, self.head, self.t2d, parse_dtype(cfg.dtype))
        prompts = heldout_prompts(self.data.heldout, cfg.eval_prompts, cfg.eval_prompt_len)
        acc = measure_acceptance(self.target, self.out, prompts, cfg.spec_steps, cfg.eval_new_tokens, cfg.dtype,
                                 cfg.device)
        held = self.data.heldout
        seq = min(cfg.seq_len, held.numel())
        rec = {"step": self.step, **acc.as_dict(), "spec_steps": cfg.spec_steps, "prompts": len(prompts)}
        if seq >= cfg.ttt_steps + 2:
            wins = windows(held, seq)[:cfg.eval_windows]
            if self.eval_runner is None or self.eval_runner.cache.layout.max_context != seq:
                self.eval_runner = TargetRunner(self.target, self.runner.capture, self.runner.aux_layers,
                                                wins.shape[0], seq, self.data.hot)
            with self.autocast():
                obj = unrolled_objective(self.head, self.eval_runner(wins), cfg.ttt_steps)
            accuracy = obj.accuracy()
            rec.update(heldout_loss=round(float(obj.loss), 4), heldout_accuracy=[round(a, 4) for a in accuracy],
                       est_accept_length=round(chain_estimate(accuracy[:cfg.spec_steps]), 4))
        rec["seconds"] = round(time.perf_counter() - t0, 2)
        self.phases.add("eval", rec["seconds"])
        return rec

    def run(self) -> dict:
        cfg = self.cfg
        t0 = time.perf_counter()
        progress = Progress(cfg, self.step)
        evals = [r for r in self.log if "accept_length" in r]
        try:
            if self.step == 0:
                evals.append(self._record(self.evaluate(), progress))
            save_every = cfg.save_every or cfg.eval_every
            while self.step < cfg.steps and not self._out_of_time(t0):
                with self.phases("train"):
                    rec = self.train_step()
                progress.step(self.step - 1, rec["loss"], rec["accuracy"][0])
                if self.step % cfg.log_every == 0:
                    self.log.append(rec)
                if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < cfg.steps:
                    evals.append(self._record(self.evaluate(), progress))
                elif save_every and self.step % save_every == 0 and self.step < cfg.steps:
                    self.save()
            if not evals or evals[-1]["step"] != self.step:
                evals.append(self._record(self.evaluate(), progress))
        finally:
            progress.close()
        return {"out": str(self.out), "kind": cfg.kind, "steps": self.step, "ttt_steps": cfg.ttt_steps,
                "draft_vocab_size": None if self.data.hot is None else self.data.hot.numel(), **self.data.info,
                "seconds": round(time.perf_counter() - t0, 2), "phases": self.phases.as_dict(), "evals": evals,
                "settings": asdict(cfg)}

    def _out_of_time(self, t0: float) -> bool:
        return self.cfg.time_budget_s is not None and time.perf_counter() - t0 >= self.cfg.time_budget_s

    def _record(self, rec: dict, progress: Progress) -> dict:
        self.log.append(rec)
        self.save()
        progress.write(f"train-draft: step {rec['step']}: accept length {rec['accept_length']:.3f} "
                       f"(chain of {rec['spec_steps']}), held-out loss {rec.get('heldout_loss', float('nan')):.4f}")
        return rec


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def train_draft(cfg: TrainConfig, render_chat: ChatRenderer | None = None) -> dict:
    return Trainer(cfg, render_chat).run()
