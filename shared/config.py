"""Engine configuration (pydantic): memory, scheduling, device and speculative decoding."""

from __future__ import annotations

import json
import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DEVICES = ("cpu", "cuda")
DEFAULT_GPU_MEMORY_FRACTION = 0.9  # one engine alone on its GPU (two sharing one: 0.45 each, as `eyrie up`)
DTYPES = ("float32", "bfloat16", "float16")  # what an engine runs in; ``auto`` resolves to one at load
HALF_DTYPES = ("bfloat16", "float16")


def resolve_dtype(dtype: str, device: str, stored: str | None) -> str:
    """The dtype an engine configured with ``dtype`` runs in on ``device``, for a checkpoint stored in ``stored``
    (its config.json's, ``checkpoint_dtype``; None when it names none). An explicit dtype is itself. ``auto``:
    on ``cuda`` the checkpoint's own when it is half (bfloat16 or float16), else bfloat16 (a float32 checkpoint,
    or none named: half float32's memory and bytes read per step, a half type as vLLM's ``auto`` picks for such a
    checkpoint, bfloat16 rather than float16 for its range); on the CPU always float32."""
    if dtype != "auto":
        return dtype
    if device.split(":")[0] != "cuda":
        return "float32"
    return stored if stored in HALF_DTYPES else "bfloat16"


def checkpoint_dtype(model_dir: str | Path) -> str | None:
    """The dtype the checkpoint at ``model_dir`` says its weights are in: config.json's ``dtype`` (as
    transformers 5 writes it) or ``torch_dtype`` (earlier ones), ``torch.`` prefix dropped; None when it names
    none, or has no readable config.json (the loader then names what is wrong with it)."""
    try:
        with open(Path(model_dir) / "config.json") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    named = (cfg.get("dtype") or cfg.get("torch_dtype")) if isinstance(cfg, dict) else None
    return named.removeprefix("torch.") if isinstance(named, str) else None


class SpecConfig(BaseModel):
    """EAGLE tree shape: ``steps`` levels, ``topk`` branches per level, ``num_draft_tokens`` nodes
    verified per step (root included). ``topk == 1`` is a chain with ``steps + 1`` nodes."""

    model_config = ConfigDict(frozen=True)
    topk: int = 1
    steps: int = 3
    num_draft_tokens: int = 4

    @model_validator(mode="after")
    def _shape(self) -> SpecConfig:
        if self.topk < 1:
            raise ValueError(f"spec topk must be >= 1, got {self.topk}")
        if self.steps < 1:
            raise ValueError(f"spec steps must be >= 1, got {self.steps}")
        n = self.num_draft_tokens
        if self.topk == 1 and n != self.steps + 1:
            raise ValueError(f"spec num_draft_tokens={n} must be steps + 1 = {self.steps + 1} for a chain (topk=1)")
        most = 1 + self.topk + (self.steps - 1) * self.topk ** 2
        if not 2 <= n <= most:
            raise ValueError(f"spec num_draft_tokens={n} must be in [2, {most}]: a tree of topk={self.topk}, "
                             f"steps={self.steps} holds at most 1 + topk + (steps - 1) * topk^2 = {most} nodes")
        return self

    @property
    def headroom(self) -> int:
        """Positions past a request's committed length that one decode step may write: the verify
        nodes in the target cache, the tree scratch or the padded extend in the draft caches."""
        return max(self.num_draft_tokens, self.topk * self.steps, self.steps + 1) + 1

    @property
    def name(self) -> str:
        """``chain3`` (topk 1, 3 steps) or ``tree-k4-s3-n8``: the shape's name in settings, costs and reports."""
        return f"chain{self.steps}" if self.topk == 1 else f"tree-k{self.topk}-s{self.steps}-n{self.num_draft_tokens}"

    @classmethod
    def parse(cls, name: str) -> SpecConfig:
        """The shape ``name`` (``SpecConfig.name``'s form) stands for."""
        chain = re.fullmatch(r"chain(\d+)", name.strip())
        if chain:
            return cls(topk=1, steps=int(chain[1]), num_draft_tokens=int(chain[1]) + 1)
        tree = re.fullmatch(r"tree-k(\d+)-s(\d+)-n(\d+)", name.strip())
        if tree is None:
            raise ValueError(f"spec candidate {name!r} is neither chainS nor tree-kK-sS-nN (chain3, tree-k4-s3-n8)")
        return cls(topk=int(tree[1]), steps=int(tree[2]), num_draft_tokens=int(tree[3]))

    def holds(self, other: SpecConfig) -> bool:
        """Whether ``other`` fits within this shape (topk, steps and verified nodes no larger): a worker
        configured with this shape can run ``other`` from the same draft states and pages."""
        return other.topk <= self.topk and other.steps <= self.steps and other.num_draft_tokens <= self.num_draft_tokens


def default_candidates(spec: SpecConfig) -> tuple[SpecConfig, ...]:
    """The adaptive policy's shapes when none are named, one for each part of the batch range, each within
    ``spec``: the configured shape (the deepest tree, for batches of 1-4), a tree of half its verified
    tokens where that is still more than a chain of its depth verifies, chains of depth min(steps, 3) down
    to 2 (batches of 8-32) and the 1-step chain (beyond, beside the plain step). Which one runs at a batch
    size is the policy's choice, from the costs measured on the device and the acceptance measured online
    (``shared/spec/policy.py``); one chain's acceptance predicts the shallower ones'."""
    trees = []
    half = spec.num_draft_tokens // 2
    if spec.topk > 1 and half > spec.steps + 1:
        trees.append(SpecConfig(topk=spec.topk, steps=spec.steps, num_draft_tokens=half))
    chains = [SpecConfig(topk=1, steps=d, num_draft_tokens=d + 1) for d in range(min(spec.steps, 3), 0, -1)]
    return tuple(dict.fromkeys([spec, *trees, *chains]))


class EngineConfig(BaseModel):
    """The engine's settings. Each one a service also takes (``services/settings.py``: flags, ``EYRIE_*``
    variables, config files) is declared here once, with its meaning; the services derive theirs from it."""

    model_config = ConfigDict(frozen=True)
    device: str = Field("cpu", description="`cpu` or `cuda` (`cuda:N`)")
    dtype: str = Field("auto", description="`auto`, `float32`, `bfloat16` or `float16`. `auto` on `cuda`: the "
                       "checkpoint's own dtype (config.json `dtype` / `torch_dtype`) when it is bfloat16 or float16, "
                       "else bfloat16 (a float32 checkpoint too); on `cpu`: float32")
    page_size: int = Field(16, description="tokens per KV page (prefill and decode must agree)")
    num_pages: int | None = Field(None, description="KV pages per pool (default: enough for `max_running` requests "
                                  "of `max_context` tokens)")
    max_running: int = Field(32, description="requests in the running batch at most")
    max_context: int | None = Field(None, description="longest prompt + output in tokens (default: the model's)")
    chunk_size: int | None = Field(512, description="prefill chunk length in tokens")  # None: whole prompts
    spec: SpecConfig | None = None
    cuda_graph: bool = Field(False, description="capture decode, draft and verify in CUDA graphs")
    cuda_graph_phases: tuple[str, ...] = ("decode", "draft", "verify", "extend")  # each switchable
    cuda_graph_mixed: bool = Field(False, description="with `cuda_graph`: steps with prefill chunks (a mixed step, a "
                                   "prefill step) replay the target's work between its attentions as CUDA graphs, "
                                   "one per layer and 32-token bucket, the attentions launched between them "
                                   "(shared/mixed_graphs.py); not yet measured against the eager step, hence off")
    cuda_graph_max_bs: int | None = Field(None, description="largest batch the CUDA graphs are captured for "
                                          "(unset = `max_running`: every batch the engine runs, as far as "
                                          "`gpu_memory_fraction` leaves room: a `graphs_capped` warning names "
                                          "where capture stopped); larger batches run eagerly, their kernels "
                                          "launched one by one")
    spec_draft_ahead: bool | None = Field(None, description="launch the next step's draft before this step's "
                                          "tokens reach the host, overlapping the host's bookkeeping (unset or "
                                          "`auto` = on with `cuda`)")
    shareable_kv: bool = False  # pools another process may map (a decode engine's, for same-host hand-offs)
    gpu_memory_fraction: float | None = Field(None, description="on a GPU without `num_pages`: the most of the "
                                              "device's memory this engine takes (weights, measured activation and "
                                              "graph reserve, KV pools), as vLLM's gpu_memory_utilization; set, the "
                                              "process's peak after warm-up is held to it (exit 2 past it); unset = "
                                              "0.9 (`eyrie up` splits 0.9 of a shared GPU evenly: prefill and "
                                              "decode 0.45 each)")

    @field_validator("gpu_memory_fraction")
    @classmethod
    def _fraction(cls, v: float | None) -> float | None:
        if v is not None and not 0 < v <= 1:
            raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {v}")
        return v
    spec_policy: str = Field("adaptive", description="per decode step: `adaptive` runs the tree shape "
                             "(`EYRIE_SPEC_CANDIDATES`) or plain step it expects the most tokens per second from, by "
                             "each shape's cost timed on the device at start and its acceptance measured as it runs; "
                             "`fixed` always speculates with the configured tree (benchmarks)")  # shared/spec/policy.py
    spec_draft_backlog: int = Field(32, ge=0, description="under the adaptive policy, plain decode steps leave the "
                                    "draft behind for up to this many positions a request, and the draft then runs "
                                    "over them in one extend (before a speculative step, or when a request's backlog "
                                    "is full); 0 = every plain step runs the draft over its position")  # spec/backlog
    # The adaptive policy's speculative shapes (``SpecConfig.name``s, each within ``spec``); the configured
    # ``spec`` is always one. None: ``default_candidates``. Fixed runs ``spec`` alone.
    spec_candidates: tuple[str, ...] | None = None
    tensor_parallel: int = Field(1, description="ranks the target is split over (heads, MLP columns, vocabulary, KV "
                                 "heads; one process per rank over NCCL on `cuda`, one GPU each from `device`'s, gloo "
                                 "on `cpu`); the draft head runs whole on every rank. A service is rank 0 and starts "
                                 "the other ranks as followers")  # shared/parallel.py
    batch_invariant: bool = Field(False, description="on `cuda`: every projection of the target and its LM head "
                                  "through one launch whose output for a row is the same bits whatever rows run "
                                  "beside it (kernels/fp8_gemv.py), at every row count: greedy output with a draft "
                                  "then equals greedy output without, token for token, in bf16 as in FP8, whatever "
                                  "the batch (cuBLAS and the few-row kernel sum a row in an order that depends on the "
                                  "row count); slower than those (docs/benchmarks.md); no effect on the CPU")
    # Off by default until the whole engine, spec and hand-off test directories have run with it on (issue 33),
    # and its GPU test has run.
    prefix_cache: bool = Field(False, description="keep prefilled prompt pages (target and draft K/V) for later "
                               "requests sharing the prefix: they skip its computation and report `cached_tokens` "
                               "(a decode instance is handed off only the prompt pages it does not hold); "
                               "unreferenced pages are evicted least recently used first when the pool needs them")

    def resolved(self, model_dir: str | Path) -> EngineConfig:
        """This config with ``dtype`` as the engine runs the checkpoint at ``model_dir`` (``resolve_dtype``):
        what the engine's weights, pools, hand-off schema and reports then carry (``auto`` never past here)."""
        if self.dtype != "auto":
            return self
        return self.model_copy(update={"dtype": resolve_dtype(self.dtype, self.device, checkpoint_dtype(model_dir))})

    @property
    def graph_max_bs(self) -> int:
        """The largest batch the CUDA graphs cover: ``cuda_graph_max_bs``, at most ``max_running`` (its default)."""
        return min(self.max_running, self.cuda_graph_max_bs or self.max_running)

    @property
    def headroom(self) -> int:
        """Positions a decode step may touch past the committed length (1 without speculation)."""
        return self.spec.headroom if self.spec is not None else 1

    def spec_shapes(self) -> tuple[SpecConfig, ...]:
        """The speculative shapes the engine runs, the configured one first (it alone under ``fixed``)."""
        spec = self.spec or SpecConfig()
        if self.spec_policy == "fixed":
            return (spec,)
        if self.spec_candidates is None:
            return default_candidates(spec)
        named = [SpecConfig.parse(n) for n in self.spec_candidates]
        return tuple(dict.fromkeys([spec, *named]))

    @model_validator(mode="after")
    def _candidates_fit(self) -> EngineConfig:
        spec = self.spec or SpecConfig()
        for name in self.spec_candidates or ():
            if not spec.holds(SpecConfig.parse(name)):
                raise ValueError(f"spec candidate {name} does not fit the configured shape {spec.name}: topk, steps "
                                 "and num_draft_tokens must each be at most the configured ones")
        return self

    @field_validator("spec_candidates", mode="before")
    @classmethod
    def _candidate_list(cls, v):  # "chain1,chain3" from a setting
        return (tuple(n.strip() for n in v.split(",") if n.strip()) or None) if isinstance(v, str) else v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if v.split(":")[0] not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {v!r}")
        return v

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        if v != "auto" and v not in DTYPES:
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {v!r}")
        return v

    @field_validator("spec_policy")
    @classmethod
    def _spec_policy(cls, v: str) -> str:
        if v not in ("fixed", "adaptive"):
            raise ValueError(f"spec_policy must be fixed or adaptive, got {v!r}")
        return v

    @field_validator("page_size", "max_running", "tensor_parallel")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v < 1:
            raise ValueError("must be >= 1")
        return v

    @field_validator("chunk_size")
    @classmethod
    def _chunk(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError("chunk_size must be >= 1 (or None for whole prompts)")
        return v
