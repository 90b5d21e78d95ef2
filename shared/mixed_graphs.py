"""Piecewise CUDA graphs for forwards with prefill chunks (mixed steps and prefill steps): everything of the target
between two attentions is one graph per token-count bucket, the attentions run eagerly between them.

A mixed step (a prefill chunk beside the decode rows) cannot be one graph: its attention depends on the chunk's
place in its prompt and on every row's keys. Run eagerly, its ~320 launches a step (GEMMs, norms, RoPE + store,
SiLU, attention) cost more host time than the GPU needs for them: at 128 streams on an H100 a mixed step took
23-29 ms of wall time for ~17 ms of kernels (docs/benchmarks.md, 2026-12-07/08). Here the target's forward is cut
at its attentions (vLLM's and SGLang's piecewise graphs, without torch.compile): piece 0 is the embedding, layer
0's input norm, its qkv projection and RoPE + K/V store; piece i is layer i-1's output projection, its
post-attention norm and MLP, then layer i's input norm, qkv and RoPE + store; the last piece ends in the final norm.
A step replays 1 + L graphs and launches L attentions (``Attention._extend``: the same launch as the eager forward,
over this step's rows only), instead of ~10 launches a layer.

Every piece of every bucket reads and writes one set of buffers sized for the largest bucket (``Buffers``; the
graphs' intermediates live in the runner's graph pool), so the memory is one step's activations, not one per piece
and bucket. Padding rows (the bucket past the step's tokens) embed token 0 at position 0 and store their K/V in the
sink slot 0 (the padding row's, ``KVCache``); attention never reads them, and the rows of a GEMM do not mix, so the
step's rows get what the eager forward computes, but for a GEMM run at the bucket's row count (cuBLAS may pick
another kernel there, as the decode graphs' padded batches do; ``batch_invariant`` turns this off).

The forward it replaces is ``LlamaForCausalLM.forward`` with fused projections, no q/k norm, no tensor parallelism,
no embedding scale and a K/V cache of the activations' dtype; anything else runs eagerly. Opt-in for now
(``cuda_graph_phases`` naming "mixed"): first measured next to the eager step before it becomes a default.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

import torch

from kernels.fused import _kept, rope_store
from shared import cuda_graphs
from shared.cuda_graphs import GraphPool, capture_stream, collector_paused, record_graph
from shared.forward_batch import ForwardBatch
from shared.model.fp8 import linear
from shared.model.layers import EXTEND_MIN_Q
from shared.model.llama import LlamaForCausalLM, TargetOutput

BUCKET = 32  # token-count buckets: every multiple of 32 up to the largest step's tokens


def unsupported(model, cache) -> str | None:
    """Why ``model`` over ``cache`` cannot run in pieces (None: it can)."""
    if not isinstance(model, LlamaForCausalLM):
        return f"{type(model).__name__} is not a Llama-family target"
    if model.tp is not None:
        return "tensor parallelism"
    if model.config.embed_scale != 1.0:
        return "a scaled embedding"
    for layer in model.model.layers:
        attn = layer.self_attn
        if layer.input_layernorm is None or attn.qkv_weight is None or attn.q_norm is not None or attn.tp is not None:
            return "a layer without fused projections, with q/k norms or split"
        if layer.mlp.gate_up_weight is None or layer.mlp.act != "silu" or layer.mlp.tp is not None:
            return "an MLP without fused projections or SwiGLU"
        k, v = cache.k[attn.cache_layer], cache.v[attn.cache_layer]
        if k.dtype != v.dtype or k.dtype != model.model.embed_tokens.weight.dtype:
            return "a K/V cache of another dtype than the activations"
    return None


def token_buckets(max_tokens: int) -> list[int]:
    """The token counts pieces are captured at: every multiple of ``BUCKET`` up to ``max_tokens`` rounded up."""
    return list(range(BUCKET, -(-max_tokens // BUCKET) * BUCKET + 1, BUCKET))


def step_tokens(config) -> int:
    """The most tokens a step with prefill chunks runs: a chunk beside every running request's decode row."""
    return (config.chunk_size or 0) + config.max_running


def reserve_bytes(model_config, config, aux: int, chunk_peak: int) -> int:
    """What the pieces need beside an eager engine (0 when ``cuda_graph_mixed`` is off): their buffers at the
    largest bucket and a graph pool of one eager chunk's peak (``chunk_peak``)."""
    buckets = token_buckets(step_tokens(config)) if config.cuda_graph and config.cuda_graph_mixed else []
    if not buckets:
        return 0
    mc = model_config
    return chunk_peak + buffer_bytes(mc.hidden_size, mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim,
                                     buckets[-1], aux, getattr(torch, config.dtype).itemsize)


def buffer_bytes(hidden: int, heads: int, kv_heads: int, head_dim: int, rows: int, aux: int, itemsize: int) -> int:
    """``Buffers``' bytes at ``rows`` rows (a model of ``hidden`` width, ``aux`` EAGLE-3 layers)."""
    width = (2 + aux) * hidden + 2 * heads * head_dim + (heads + 2 * kv_heads) * head_dim
    return rows * (width * itemsize + head_dim * 4 + 3 * 8)


@dataclass
class Buffers:
    """Every piece's inputs and outputs, rows for the largest bucket; a bucket uses the first rows."""

    ids: torch.Tensor  # [N] token ids
    positions: torch.Tensor  # [N]
    loc: torch.Tensor  # [N] the slot each row's K/V goes to (padding rows: 0, the sink)
    cos: torch.Tensor  # [N, D/2] float32
    sin: torch.Tensor
    x: torch.Tensor  # [N, H] the residual stream: the layer's input (its attention's residual)
    q: torch.Tensor  # [N, Hq, D] rotated queries
    qkv: torch.Tensor  # [N, (Hq + 2 Hk) D] the projection, its keys rotated: k and v are views of it
    o: torch.Tensor  # [N, Hq * D] the attention's output
    h: torch.Tensor  # [N, H] the final norm's output
    aux: torch.Tensor | None  # [N, len(aux_layers), H] the EAGLE-3 layers' inputs

    @classmethod
    def allocate(cls, model: LlamaForCausalLM, loc_dtype: torch.dtype, rows: int, aux_layers: tuple[int, ...]):
        mc = model.config
        attn = model.model.layers[0].self_attn
        d, hq, hk, hidden = attn.head_dim, attn.num_heads, attn.num_kv_heads, mc.hidden_size
        w = model.model.embed_tokens.weight
        dev, dt = w.device, w.dtype

        def z(*shape, dtype=dt):
            return torch.zeros(rows, *shape, dtype=dtype, device=dev)

        return cls(ids=z(dtype=torch.int64), positions=z(dtype=torch.int64), loc=z(dtype=loc_dtype),
                   cos=z(d // 2, dtype=torch.float32), sin=z(d // 2, dtype=torch.float32), x=z(hidden),
                   q=z(hq, d), qkv=z((hq + 2 * hk) * d), o=z(hq * d), h=z(hidden),
                   aux=z(len(aux_layers), hidden) if aux_layers else None)


class MixedGraphs:
    """The target's forward over a batch with prefill chunks, in pieces between its attentions (see the module's
    docstring). ``applies(batch)`` says whether a batch runs here; ``forward`` is ``model.forward``'s contract."""

    def __init__(self, model: LlamaForCausalLM, cache, max_tokens: int, enabled: bool,
                 aux_layers: tuple[int, ...] = (), pool: GraphPool | None = None, capture: bool | None = None,
                 failures: list | None = None):
        self.model, self.cache, self.aux_layers = model, cache, tuple(aux_layers)
        self.why_not = unsupported(model, cache) if enabled else "off"
        self.enabled = self.why_not is None and max_tokens > 0
        self.buckets = token_buckets(max_tokens) if self.enabled else []
        self.capture = self.enabled and (torch.cuda.is_available() if capture is None else capture)
        self.pool = GraphPool() if pool is None else pool
        self.failures = [] if failures is None else failures
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}  # bucket -> its pieces' graphs
        self.capture_s = 0.0
        self.buf: Buffers | None = None
        self.layers = list(model.model.layers)
        self.aux_slots: dict[int, list[int]] = {}  # layer -> its places among the features (a layer may repeat)
        for slot, layer in enumerate(self.aux_layers):
            self.aux_slots.setdefault(layer, []).append(slot)

    def bucket(self, tokens: int) -> int | None:
        return next((b for b in self.buckets if b >= tokens), None)

    def applies(self, batch: ForwardBatch) -> bool:
        meta = batch.attn
        return (self.enabled and meta.custom_mask is None and meta.max_q_len is not None
                and meta.max_q_len >= EXTEND_MIN_Q and self.bucket(batch.input_ids.shape[0]) is not None)

    # ---- the pieces: pure tensor work on the buffers' first ``n`` rows ------------------------------------
    def _store(self, i: int, n: int, h: torch.Tensor, x: torch.Tensor) -> None:
        """Layer ``i``'s attention input from its normed input ``h`` (its residual ``x``): qkv, RoPE, K/V stored."""
        b, attn = self.buf, self.layers[i].self_attn
        b.x[:n].copy_(x)
        for slot in self.aux_slots.get(i, ()):
            b.aux[:n, slot].copy_(x)
        qkv = linear(h, attn.qkv_weight, attn.qkv_bias)
        rope_store(qkv, b.cos[:n], b.sin[:n], self.cache.k[attn.cache_layer], self.cache.v[attn.cache_layer],
                   b.loc[:n], attn.num_heads, attn.num_kv_heads, keep_kv=True, q_out=b.q[:n])
        b.qkv[:n].copy_(qkv)  # the keys rotated in place by rope_store

    def _first(self, n: int) -> None:
        b, layer = self.buf, self.layers[0]
        cos, sin = layer.self_attn.rotary.cos_sin(b.positions[:n])
        b.cos[:n].copy_(cos)
        b.sin[:n].copy_(sin)
        x = self.model.model.embed_tokens(b.ids[:n])
        self._store(0, n, layer.input_layernorm(x), x)

    def _after(self, i: int, n: int) -> None:
        """Layer ``i``'s output projection, norm and MLP; then layer i+1's attention input, or the final norm."""
        b, layer = self.buf, self.layers[i]
        attn = layer.self_attn
        out = linear(b.o[:n], attn.o_proj.weight, attn.o_proj.bias)
        h, x = layer.post_attention_layernorm.add_forward(out, b.x[:n])
        mlp = layer.mlp(h)
        if i + 1 < len(self.layers):
            h, x = self.layers[i + 1].input_layernorm.add_forward(mlp, x)
            self._store(i + 1, n, h, x)
        else:
            b.h[:n].copy_(self.model.model.norm.add_forward(mlp, x)[0])

    def _pieces(self, n: int):
        return [lambda: self._first(n)] + [lambda i=i: self._after(i, n) for i in range(len(self.layers))]

    # ---- capture --------------------------------------------------------------------------------------
    def capture_all(self) -> int:
        """Capture every bucket's pieces now (the engine's start, beside the other graphs); a failure turns the
        pieces off for good (recorded in ``failures``), the eager forward serving on. Returns the graphs made."""
        if not self.capture:
            return 0
        t0 = time.perf_counter()
        try:
            for n in self.buckets:
                if n not in self.graphs and not self._capture(n):
                    break
        finally:
            self.capture_s += time.perf_counter() - t0
        torch.cuda.empty_cache()
        return sum(len(g) for g in self.graphs.values())

    @torch.inference_mode()
    def _ensure_buffers(self) -> Buffers:
        if self.buf is None:
            self.buf = Buffers.allocate(self.model, self.cache.req_to_token.table.dtype, self.buckets[-1],
                                        self.aux_layers)
        return self.buf

    @torch.inference_mode()
    def _capture(self, n: int) -> bool:
        b = self._ensure_buffers()
        for buf in (b.ids, b.positions, b.loc):  # the warm-up runs store K/V: into the sink slot only
            buf[:n].zero_()
        stream = capture_stream()
        stream.wait_stream(torch.cuda.current_stream())
        pieces = self._pieces(n)
        with torch.cuda.stream(stream):  # every kernel compiled and loaded before capture (padding rows only)
            for piece in pieces:
                piece()
        torch.cuda.synchronize()
        rng = torch.cuda.get_rng_state()
        graphs = []
        gc.collect()
        try:
            with collector_paused():
                for piece in pieces:
                    graphs.append(record_graph(piece, stream, self.pool)[0])
        except Exception as e:  # noqa: BLE001 (any failure inside capture is contained the same way)
            self.capture = False
            self.graphs.clear()
            cuda_graphs.contain_failure(self.failures, "mixed", n, e, rng)
            return False
        self.graphs[n] = graphs
        return True

    # ---- a forward ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache, capture: str = "none",
                aux_layers: tuple[int, ...] = ()) -> TargetOutput:
        """``model.forward(batch, cache, capture, aux_layers)`` for a batch ``applies`` took."""
        if cache is not self.cache or (capture == "aux" and tuple(aux_layers) != self.aux_layers):
            raise ValueError("the mixed pieces were built for another cache or other EAGLE-3 layers")
        t = batch.input_ids.shape[0]
        n = self.bucket(t)
        b = self._ensure_buffers()
        if self.capture and n not in self.graphs:  # a bucket not captured at start (or capture_all not called)
            self._capture(n)
        for buf, src in ((b.ids, batch.input_ids), (b.positions, batch.positions), (b.loc, batch.out_cache_loc)):
            buf[t:n].zero_()  # padding rows: token 0 at position 0, stored in the sink slot
            buf[:t].copy_(src)
        graphs = self.graphs.get(n) if self.capture else None
        pieces = graphs if graphs is not None else self._pieces(n)
        run = (lambda p: p.replay()) if graphs is not None else (lambda p: p())
        run(pieces[0])
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            q, kv = b.q[:t], _kept(b.qkv[:t], None, attn.num_heads, attn.num_kv_heads, attn.head_dim)
            dest = b.o[:t].view(q.shape)
            o = attn._extend(q, cache.k[attn.cache_layer], cache.v[attn.cache_layer], batch, kv, out=dest)
            if o.data_ptr() != dest.data_ptr():  # (the kernels write ``out`` itself)
                dest.copy_(o)
            run(pieces[i + 1])
        h = b.h[:t]
        rows = h if batch.logits_rows is None else h[batch.logits_rows]
        return TargetOutput(
            logits=self.model.lm_logits(rows),
            hidden=h.clone() if capture == "last" else None,
            aux_hidden=b.aux[:t].reshape(t, -1).clone() if capture == "aux" else None,
        )


__all__ = ["BUCKET", "Buffers", "MixedGraphs", "buffer_bytes", "reserve_bytes", "step_tokens", "token_buckets",
           "unsupported"]
