"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2) in flax nnx, and their `Family`s.

Computed exactly as transformers computes it: RMSNorm in float32, RoPE with rotate_half,
grouped-query attention, SwiGLU. The KV cache is passed in and returned, never held as
module state, so that the engine can jit a pure function of (params, tokens, positions,
cache) with fixed shapes and donate the cache.

The layers are the base other families build on: an attention subclass changes what q and k
go through before RoPE (`Attention.normalize_qk`, Qwen3's per-head norms), a decoder subclass
which MLP a layer has (`LlamaForCausalLM.make_mlp`, Qwen3-MoE's experts).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.models import linear
from jaxserve.models.contract import Family
from jaxserve.models.linear import Linear
from jaxserve.models.model_config import ModelConfig
from pallas_kernels import reference
from pallas_kernels.reference import RaggedMetadata

# per layer (k_pages, v_pages), or quantized (k_pages, v_pages, k_scales, v_scales); or one such
# tuple of every layer's pages stacked (reference.pool_layer: the runner's pool off a mesh)
KVCache = tuple[tuple[jax.Array, ...], ...]


# An attention backend's forward (runner/attention.py): (q, k, v, cache tuple, meta, *, scale)
# -> out, where k/v are this step's new keys and values, already written into the pages (as
# the pages hold them: reference.write_kv).
PagedAttentionFn = Callable[..., jax.Array]


# The lanes of mean_square's fixed-order sum.
_SUM_LANES = 16


def mean_square(x32):
    """The mean of x32 * x32 over the last axis [..., 1], summed in one fixed order per row: a
    lane-wise sum of the row's 16-wide slices in sequence (the last one zero-padded), then a
    halving tree over the lanes.

    XLA's own reduce picks its association order by shape (rows in vector lanes when there are
    several, one row's elements in lanes when there is one), so `jnp.mean` gave a token a
    last-bit different norm in an 8-row step than alone: 93 of 300 rows differed. Explicit adds
    are not reassociated, so a token's result does not depend on how many tokens share its step.
    That is what keeps speculative verification's output equal to plain decoding: a bfloat16
    matmul rounds its input to 8 bits of mantissa, which turns a last-bit difference into a
    0.4% one, and greedy decoding then flips a near tie (tests/test_llama.py,
    test_rms_norm_is_row_count_invariant)."""
    h = x32.shape[-1]
    sq = x32 * x32
    if h % _SUM_LANES:  # zeros to a whole slice: adding them is exact
        sq = jnp.pad(sq, [(0, 0)] * (sq.ndim - 1) + [(0, -h % _SUM_LANES)])
    rows = sq.reshape(*sq.shape[:-1], -1, _SUM_LANES)  # as fast as XLA's reduce (slices of sq: 2.6x slower)
    acc = rows[..., 0, :]
    for i in range(1, rows.shape[-2]):
        acc = acc + rows[..., i, :]
    w = _SUM_LANES
    while w > 1:
        w //= 2
        acc = acc[..., :w] + acc[..., w : 2 * w]
    return acc / h


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(mean_square(x32) + self.eps)
        return self.weight[...] * x32.astype(x.dtype)


def _linear(din: int, dout: int, bias: bool, dtype, rngs: nnx.Rngs, std: float) -> Linear:
    return Linear(din, dout, bias=bias, dtype=dtype, rngs=rngs, std=std)


# How each projection splits across chips (tensor parallelism): column-parallel projections
# make whole heads (or MLP columns) per chip, row-parallel ones consume them and all-reduce.
# K/V projections are column-parallel only when the KV heads divide by the chip count.
TP_LAYOUT = {
    "q_proj": linear.COLUMN,
    "k_proj": linear.COLUMN,
    "v_proj": linear.COLUMN,
    "gate_proj": linear.COLUMN,
    "up_proj": linear.COLUMN,
    "lm_head": linear.COLUMN,
    "o_proj": linear.ROW,
    "down_proj": linear.ROW,
}


def rope_tables(positions, inv_freq, dtype):
    """cos and sin [B, T, 1, D] of positions [B, T] (float32 angles, as transformers), computed
    once per forward pass and shared by every layer's q and k."""
    freqs = positions[..., None].astype(jnp.float32) * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    tables = lambda e: (jnp.cos(e).astype(dtype)[:, :, None, :], jnp.sin(e).astype(dtype)[:, :, None, :])  # noqa: E731
    if jax.default_backend() != "cpu":
        return tables(emb)
    # On the CPU, under a cond, the tables are one computed result. As plain ops (even behind
    # an optimization barrier, which XLA:CPU drops) XLA fuses cos/sin into every layer's q and
    # k rotation and recomputes them per head: 400k sincos calls, 3.5% of a batch-32 step.
    # (Elsewhere plain ops: a GPU cond's predicate goes through the host, and recomputing the
    # tables costs an accelerator nothing.)
    return jax.lax.cond(jnp.all(positions >= 0), tables, tables, emb)


def rope(x, cos, sin):
    """x [B, T, N, D]: rotate_half RoPE."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, std: float):
        d, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = _linear(d, cfg.num_heads * hd, cfg.qkv_bias, dtype, rngs, std)
        self.k_proj = _linear(d, cfg.num_kv_heads * hd, cfg.qkv_bias, dtype, rngs, std)
        self.v_proj = _linear(d, cfg.num_kv_heads * hd, cfg.qkv_bias, dtype, rngs, std)
        self.o_proj = _linear(cfg.num_heads * hd, d, cfg.o_bias, dtype, rngs, std)
        self.cfg = cfg
        self.fused = False
        # This layer's sliding window (DecoderLayer sets it from cfg.layer_window); None: full
        self.window: int | None = None

    def normalize_qk(self, q, k):
        """q [B, T, N, D] and k [B, T, KVH, D] as RoPE takes them (Llama: unchanged)."""
        return q, k

    def fuse_projections(self) -> None:
        """q_proj absorbs k_proj and v_proj (linear.pack_native does this on the CPU)."""
        self.q_proj.absorb([self.k_proj, self.v_proj])
        del self.k_proj, self.v_proj
        self.fused = True

    def __call__(self, x, rope_cs, cache, meta, attn_fn):
        b, t, _ = x.shape
        c = self.cfg
        if self.fused:
            nq, nkv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
            q, k, v = jnp.split(self.q_proj(x), [nq, nq + nkv], axis=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(b, t, c.num_heads, c.head_dim)
        k = k.reshape(b, t, c.num_kv_heads, c.head_dim)
        v = v.reshape(b, t, c.num_kv_heads, c.head_dim)
        q, k = self.normalize_qk(q, k)
        q, k = rope(q, *rope_cs), rope(k, *rope_cs)
        scale = c.attn_scale
        if cache is None:
            out = reference.causal_attention(q, k, v, scale, sliding_window=self.window)
        else:
            cache, k, v = reference.write_kv(cache, k, v, meta.slot_mapping)
            # a backend is asked for a window only by a layer that has one
            out = attn_fn(q, k, v, cache, meta, scale=scale, **({"window": self.window} if self.window else {}))
        return self.o_proj(out.reshape(b, t, -1)), cache


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, std: float):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = _linear(d, f, cfg.mlp_bias, dtype, rngs, std)
        self.up_proj = _linear(d, f, cfg.mlp_bias, dtype, rngs, std)
        self.down_proj = _linear(f, d, cfg.mlp_bias, dtype, rngs, std)
        self.fused = False

    def fuse_projections(self) -> None:
        """gate_proj absorbs up_proj (linear.pack_native does this on the CPU)."""
        self.gate_proj.absorb([self.up_proj])
        del self.up_proj
        self.fused = True

    def __call__(self, x):
        if self.fused:
            gate, up = jnp.split(self.gate_proj(x), 2, axis=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.activation(gate) * up)

    def activation(self, gate):
        """The gate's nonlinearity (SwiGLU: SiLU; Gemma: GELU, tanh form)."""
        return jax.nn.silu(gate)


class DecoderLayer(nnx.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        dtype,
        rngs: nnx.Rngs,
        std: float,
        attention: type[Attention] = Attention,
        mlp: Callable[..., nnx.Module] = MLP,
        layer: int = 0,
    ):
        """attention: the attention class; mlp: builds the MLP as mlp(cfg, dtype, rngs, std);
        layer: the layer's index (its sliding window, `cfg.layer_window`)."""
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = attention(cfg, dtype, rngs, std)
        self.self_attn.window = cfg.layer_window(layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = mlp(cfg, dtype, rngs, std)

    def __call__(self, x, rope_cs, cache, meta, attn_fn):
        h, cache = self.self_attn(self.input_layernorm(x), rope_cs, cache, meta, attn_fn)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), cache


class LlamaForCausalLM(nnx.Module):
    """Parameter names mirror transformers' so that loading is a rename and a transpose.
    A `contract.CausalLM`. Subclasses pick the attention (`attention`) and each layer's MLP
    (`make_mlp`)."""

    attention: type[Attention] = Attention
    decoder_layer: type[nnx.Module] = DecoderLayer

    def make_mlp(self, layer: int) -> Callable[..., nnx.Module]:
        """What builds layer `layer`'s MLP, called as (cfg, dtype, rngs, std)."""
        return MLP

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None, init_std: float = 0.02):
        rngs = rngs or nnx.Rngs(0)
        self.cfg = cfg
        self.dtype = dtype
        self.embed_tokens = nnx.Embed(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype=dtype,
            param_dtype=dtype,
            rngs=rngs,
            embedding_init=nnx.initializers.normal(init_std),
        )
        self.layers = nnx.List(
            [
                self.decoder_layer(cfg, dtype, rngs, init_std, self.attention, self.make_mlp(i), layer=i)
                for i in range(cfg.num_layers)
            ]
        )
        self.norm = self.make_norm(cfg.hidden_size)
        if not cfg.tie_word_embeddings:
            self.lm_head = _linear(cfg.hidden_size, cfg.vocab_size, False, dtype, rngs, init_std)
        self.untied = False  # untie_lm_head: a tied model's vocabulary projection as a Linear of its own

    def make_norm(self, dim: int) -> nnx.Module:
        """The final norm (Gemma's scales by 1 + w)."""
        return RMSNorm(dim, self.cfg.rms_norm_eps, self.dtype)

    def embed(self, tokens) -> jax.Array:
        """The hidden states entering layer 0 (Gemma scales them by sqrt(hidden))."""
        return self.embed_tokens(tokens)

    def rope(self, positions, dtype):
        """The RoPE tables every layer is handed (one pair here; a family whose layers differ
        hands a pair per kind and its layers pick theirs)."""
        return rope_tables(positions, jnp.asarray(self.cfg.inv_freq()), dtype)

    def input_embedding(self) -> jax.Array:
        """The token embedding table [V, H] (shared with a draft head: models/eagle.py)."""
        return self.embed_tokens.embedding[...]

    def untie_lm_head(self) -> None:
        """Give a tied model an lm_head of its own, a copy of the embedding transposed, so the
        native CPU matmul packs it like every projection: the vocabulary projection then streams
        bfloat16 panels (half the bytes of XLA's float32 dot over the embedding, the largest
        single read of a small model's step) and takes several rows (a speculative verify's
        k + 1) without XLA repacking the [V, H] matrix on every call. The lookup keeps the
        embedding. No-op for an untied model."""
        if not self.cfg.tie_word_embeddings or self.untied:
            return
        emb = self.embed_tokens.embedding[...]
        head = _linear(self.cfg.hidden_size, self.cfg.vocab_size, False, self.dtype, nnx.Rngs(0), 0.0)
        head.kernel = nnx.Param(jnp.asarray(emb).T)
        self.lm_head = head
        self.untied = True

    def __call__(
        self,
        tokens,
        positions,
        kv_cache: KVCache | None = None,
        meta: RaggedMetadata | None = None,
        attn_fn: PagedAttentionFn | None = None,
        logits_index=None,
        token_index=None,
        num_live_tokens=None,
        return_hidden: bool = False,
        num_live_logits=None,
    ):
        """tokens/positions [B, T]. Without a cache: dense causal attention over the batch
        (right padding is harmless under a causal mask). With one, `meta` describes the B*T
        tokens as a ragged batch (flattened row-major) for `attn_fn`. Only the selected
        positions reach the vocabulary projection, which is most of a chunk's FLOPs otherwise:
        logits_index [B], one position per row (-> [B, V]), or token_index [M], flat indices
        over the B*T tokens (-> [M, V]). num_live_tokens (traced int32): only the first that many
        of the B*T tokens are real (a ragged step's padding follows them); the native CPU matmul
        skips the rest (`linear.live_rows`). return_hidden: also return the final-norm hidden
        state of every token [B, T, H] (what the vocabulary projection reads: the features an
        EAGLE draft head is conditioned on, models/eagle.py). num_live_logits (traced int32): only
        the first that many selected positions are real (the rest pad a row bucket); the native
        CPU matmul projects only those onto the vocabulary, the step's largest single read."""
        x = self.embed(tokens)
        rope_cs = self.rope(positions, x.dtype)
        pool, n = kv_cache, len(self.layers)  # one cache tuple a layer, or every layer's stacked
        with linear.live_rows(num_live_tokens):
            for i, layer in enumerate(self.layers):
                m = layer_meta(meta, self.cfg.is_sliding(i))
                x, c = layer(x, rope_cs, None if pool is None else reference.pool_layer(pool, i, n), m, attn_fn)
                pool = None if pool is None else reference.pool_with_layer(pool, i, c)
        x = self.norm(x)
        hidden = x
        if token_index is not None:
            x = x.reshape(-1, x.shape[-1])[token_index]
        elif logits_index is not None:
            x = jnp.take_along_axis(x, logits_index[:, None, None], axis=1)[:, 0]
        if self.cfg.tie_word_embeddings and not self.untied:
            logits = self.embed_tokens.attend(x)
        else:
            with linear.live_rows(num_live_logits):
                logits = self.lm_head(x)
        if return_hidden:
            return logits.astype(jnp.float32), pool, hidden
        return logits.astype(jnp.float32), pool


def layer_meta(meta, sliding: bool):
    """A layer's attention metadata: `meta` as given, or, when the step has a page pool for the
    sliding layers (a pair: the full layers' metadata, the local layers'), the one of the
    layer's group: a sliding layer's block table and slots point into the local pool."""
    if isinstance(meta, tuple):
        return meta[1] if sliding else meta[0]
    return meta


def _mistral_config(get) -> dict:
    """Mistral's window applies without `use_sliding_window`, in every layer (masked by the
    attention backends)."""
    return {"sliding_window": get("sliding_window")}


def _qwen2_config(get) -> dict:
    """Qwen2 has q/k/v biases and none on o_proj, whatever `attention_bias` says."""
    return {"qkv_bias": True, "o_bias": False}


# llama.cpp's converter permutes a `llama` GGUF's Q/K rows (gguf.unpermute_qk undoes it)
LLAMA = Family(model=LlamaForCausalLM, tp_layout=TP_LAYOUT, gguf_unpermute_qk=True)
MISTRAL = Family(model=LlamaForCausalLM, tp_layout=TP_LAYOUT, hf_config=_mistral_config)
QWEN2 = Family(model=LlamaForCausalLM, tp_layout=TP_LAYOUT, hf_config=_qwen2_config)
