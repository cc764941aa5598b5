"""KV-cache capacity and cost math: the library behind ``jaxserve kv-math``.

Answers, before a machine is rented: for this model, this accelerator and this
context length, how many requests fit at once, how fast can decode go, and what
does a token cost?  Every speed figure is a roofline lower bound (bytes over
bandwidth, FLOPs over peak), so real engines land above the step times and below
the tokens/s printed here.

Plain Python + numpy on purpose: the engine and the CLI call this at start-up to
refuse configurations that cannot fit, and that check must not pay for a jax
import. It imports nothing of jaxserve: the command-line tool, its plot and the host
measurements live in ``jaxserve/tools/kv_math_cli.py``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

GiB = 1024**3
GB = 10**9
DTYPE_BYTES: dict[str, float] = {"bf16": 2, "fp16": 2, "fp8": 1, "int8": 1, "fp32": 4, "int4": 0.5}
WEIGHT_ONLY_DTYPES = frozenset({"int4"})  # no engine here keeps a 4-bit KV cache
# An 8-bit KV cache keeps a bfloat16 scale per token per KV head beside K and beside V
# (jaxserve's kv_cache_dtype="int8"/"fp8"), so a token-head costs head_dim + 2 bytes, not head_dim.
KV_SCALE_BYTES: dict[str, int] = {"int8": 2, "fp8": 2}
DEFAULT_ACTIVATION_RESERVE_FRACTION = 0.05  # of each chip's HBM: prefill-chunk activations, logits, XLA scratch
DEFAULT_PAGE_SIZE = 16


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _positive(name: str, value: Any, allow_zero: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'non-negative' if allow_zero else 'positive'}, got {value!r}")
    return float(value)


def dtype_bytes(dtype: str, field_name: str = "dtype", weights: bool = True) -> float:
    """Bytes per element; the field name goes into the error so a CLI user sees which flag was wrong."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"{field_name}: unknown dtype {dtype!r}; choose from {', '.join(DTYPE_BYTES)}")
    if not weights and dtype in WEIGHT_ONLY_DTYPES:
        raise ValueError(f"{field_name}: {dtype} is for weights only, not for the KV cache")
    return DTYPE_BYTES[dtype]


# --------------------------------------------------------------------------- models
@dataclass(frozen=True)
class ModelShape:
    """The few numbers of a decoder-only transformer that decide memory and FLOPs."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 8192
    name: str = "custom"
    qk_norm: bool = False  # Qwen3, Gemma 3: an RMSNorm weight of head_dim on q and on k in every layer
    # Mixture of experts (Qwen3-MoE): num_moe_layers of the layers have num_experts SwiGLU experts
    # of width moe_intermediate_size and a router [E, hidden]; each token runs num_experts_per_tok
    # of them. The other layers keep a dense MLP of intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_moe_layers: int = 0
    # Hidden-size norms in every block: 2 in Llama's (before attention and the MLP), 4 in
    # Gemma 3's (before and after each)
    block_norms: int = 2
    # Sliding-window attention: num_local_layers of the layers see only the last sliding_window
    # positions, and the KV manager frees their pages that fell out of it, so they hold about
    # sliding_window tokens of KV whatever the context (Gemma 3: 5 of every 6; Mistral: all)
    sliding_window: int = 0
    num_local_layers: int = 0

    def __post_init__(self) -> None:
        for f in (
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
        ):
            _positive_int(f, getattr(self, f))
        if self.num_experts:
            for f in ("num_experts_per_tok", "moe_intermediate_size", "num_moe_layers"):
                _positive_int(f, getattr(self, f))
            if self.num_experts_per_tok > self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts ({self.num_experts})"
                )
            if self.num_moe_layers > self.num_layers:
                raise ValueError(f"num_moe_layers ({self.num_moe_layers}) exceeds num_layers ({self.num_layers})")
        if self.num_local_layers > self.num_layers or (self.num_local_layers > 0) != (self.sliding_window > 0):
            raise ValueError(
                f"num_local_layers ({self.num_local_layers}) needs a sliding_window and at most num_layers "
                f"({self.num_layers})"
            )

    @classmethod
    def from_hf_config(cls, cfg: Any, name: str | None = None) -> "ModelShape":
        """Accept a transformers config object or the dict of a config.json, since users have either."""
        get = cfg.get if isinstance(cfg, Mapping) else (lambda k, d=None: getattr(cfg, k, d))
        for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
            if get(key) is None:
                raise ValueError(f"model config: missing {key!r}")
        hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
        head_dim = get("head_dim")  # Qwen2 configs omit it; Gemma's differs from hidden/heads
        if head_dim is None:
            if hidden % heads:
                raise ValueError(f"model config: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
            head_dim = hidden // heads
        layers = int(get("num_hidden_layers"))
        experts = int(get("num_experts", None) or get("num_local_experts", None) or 0)
        moe = {}
        if experts:
            only, step = get("mlp_only_layers", None) or (), int(get("decoder_sparse_step", None) or 1)
            moe = dict(
                num_experts=experts,
                num_experts_per_tok=int(get("num_experts_per_tok")),
                moe_intermediate_size=int(
                    get("moe_intermediate_size", None) or get("intermediate_size")
                ),  # Mixtral: one width
                num_moe_layers=len(sparse_layers(layers, experts, only, step)),
            )
        return cls(
            num_layers=layers,
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(get("num_key_value_heads") or heads),  # absent in older MHA configs
            head_dim=int(head_dim),
            intermediate_size=int(get("intermediate_size")),
            vocab_size=int(get("vocab_size")),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            max_position_embeddings=int(get("max_position_embeddings") or 8192),
            name=name or get("_name_or_path") or get("name_or_path") or get("model_type") or "custom",
            qk_norm=get("model_type") in ("qwen3", "qwen3_moe", "gemma3", "gemma3_text"),
            block_norms=4 if get("model_type") in ("gemma3", "gemma3_text") else 2,
            **moe,
            **_sliding_layers(get, layers),
        )

    @classmethod
    def from_path(cls, path: str | Path) -> "ModelShape":
        """A checkpoint directory, its config.json, or a workload JSON whose ``model`` dict is a config."""
        p = Path(path)
        cfg_file = p / "config.json" if p.is_dir() else p
        if not cfg_file.is_file():
            raise ValueError(f"model: no config.json at {str(cfg_file)!r}")
        try:
            data = json.loads(cfg_file.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"model: cannot read {str(cfg_file)!r}: {e}") from None
        if isinstance(data.get("model"), Mapping) and "requests" in data:
            return cls.from_hf_config(data["model"], name=cfg_file.stem)
        name = cfg_file.parent.name if cfg_file.name == "config.json" and cfg_file.parent.name else cfg_file.stem
        return cls.from_hf_config(data, name=name)

    @property
    def num_params(self) -> int:
        """Embeddings, LM head unless tied, q/k/v/o, the MLPs (dense, or router and every expert),
        RMSNorm weights (2 or, in Gemma 3, 4 per block; q/k norms where the model has them).

        Qwen2's q/k/v biases are left out: under 0.01% of the weights, and presets stay comparable.
        """
        d = self.hidden_size
        attn = d * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        norms = self.block_norms * d + (2 * self.head_dim if self.qk_norm else 0)
        dense_layers = self.num_layers - self.num_moe_layers
        mlps = dense_layers * 3 * d * self.intermediate_size
        mlps += self.num_moe_layers * self.num_experts * (d + self.expert_params)  # router row + expert
        embed = self.vocab_size * d
        return embed * (1 if self.tie_word_embeddings else 2) + self.num_layers * (attn + norms) + mlps + d

    @property
    def expert_params(self) -> int:
        """One expert of one layer: gate, up and down projections."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def active_params(self) -> int:
        """Parameters one token runs through: everything but the experts it is not routed to
        (num_experts - num_experts_per_tok per MoE layer). Equals num_params for a dense model."""
        idle = self.num_experts - self.num_experts_per_tok
        return self.num_params - self.num_moe_layers * idle * self.expert_params

    @property
    def streamed_params(self) -> int:
        """Parameters one decode step reads in full and multiplies: all but an untied input embedding,
        which is a gather of B rows. A tied table is read whole, as the LM head. For a mixture of
        experts this is every expert; a step reads `streamed_params_at(batch)`."""
        return self.num_params - (0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size)

    @property
    def active_streamed_params(self) -> int:
        """Parameters a decode step multiplies per token (its FLOPs are twice this)."""
        return self.streamed_params - (self.num_params - self.active_params)

    def streamed_params_at(self, batch: float) -> float:
        """Parameters a decode step of `batch` tokens reads: the shared ones (attention, dense
        MLPs, routers, norms, LM head) plus, per MoE layer, the experts its tokens touch."""
        idle = self.num_experts - experts_touched(self.num_experts, self.num_experts_per_tok, batch)
        return self.streamed_params - self.num_moe_layers * idle * self.expert_params


def experts_touched(num_experts: int, top_k: int, batch: float) -> float:
    """Expected distinct experts one MoE layer reads in a step of `batch` tokens:
    E * (1 - (1 - k/E)^batch), each token picking k of E experts independently and uniformly
    (a balanced router; a skewed one touches fewer, so this errs towards more bytes). Exactly k
    at batch 1, E as batch grows; 0 for a dense model."""
    if not num_experts:
        return 0.0
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def sparse_layers(num_layers: int, num_experts: int, mlp_only_layers, decoder_sparse_step: int) -> tuple[int, ...]:
    """The layers with experts, as transformers' `Qwen3MoeDecoderLayer` picks them: all but
    `mlp_only_layers`, every `decoder_sparse_step`-th."""
    if num_experts <= 0:
        return ()
    only = set(mlp_only_layers or ())
    return tuple(i for i in range(num_layers) if i not in only and (i + 1) % decoder_sparse_step == 0)


def _sliding_layers(get, layers: int) -> dict:
    """sliding_window and num_local_layers of a config.json: Gemma 3's `layer_types` (or every
    `sliding_window_pattern`-th layer global, 6 by default), Mistral's window in every layer,
    Qwen2's only with `use_sliding_window`."""
    window = get("sliding_window", None)
    model_type = get("model_type", None)
    if not window or (model_type in ("qwen2", "qwen3", "qwen3_moe") and not get("use_sliding_window", False)):
        return {}
    types = get("layer_types", None)
    if types:
        local = sum(t == "sliding_attention" for t in types)
    elif model_type in ("gemma3", "gemma3_text"):
        pattern = int(get("sliding_window_pattern", None) or 6)
        local = sum(1 for i in range(layers) if (i + 1) % pattern)
    else:
        local = layers
    return {"sliding_window": int(window), "num_local_layers": local} if local else {}


def local_pages_per_request(window: int, page_size: int, chunk: int = 1) -> int:
    """The local pages a request holds at most while a step computes `chunk` of its tokens: the
    window's keys before the chunk (W - 1 positions, on at most ceil((W - 1) / page_size) + 1
    pages) and the chunk's own. A decode step (chunk 1) holds about W / page_size + 1."""
    return -(-(window - 1 + chunk) // page_size) + 1


def local_kv_tokens(model: "ModelShape", context_len: float, page_size: int | None = None) -> float:
    """Tokens of KV a request of context_len holds in each local layer: its context, at most
    the window's pages (a decoding request's)."""
    if not model.num_local_layers:
        return context_len
    cap = local_pages_per_request(model.sliding_window, page_size) * page_size if page_size else model.sliding_window
    return min(context_len, cap)


def _llama(
    name: str, layers: int, hidden: int, heads: int, kv: int, inter: int, vocab: int, max_pos: int
) -> ModelShape:
    return ModelShape(layers, hidden, heads, kv, hidden // heads, inter, vocab, False, max_pos, name)


PRESETS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        _llama("llama-2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
        _llama("llama-3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
        _llama("llama-3.1-8b", 32, 4096, 32, 8, 14336, 128256, 131072),
        _llama("llama-3-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
        _llama("llama-3.1-70b", 80, 8192, 64, 8, 28672, 128256, 131072),
        _llama("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064, 32768),
        _llama("mistral-7b", 32, 4096, 32, 8, 14336, 32768, 32768),  # v0.3 vocabulary
        # Qwen/Qwen3-30B-A3B's config.json: 48 layers, all MoE (128 experts of 768, top 8)
        ModelShape(48, 2048, 32, 4, 128, 6144, 151936, False, 40960, "qwen3-30b-a3b", True, 128, 8, 768, 48),
    )
}


def resolve_model(spec: str | ModelShape) -> ModelShape:
    """Preset name, checkpoint directory, config.json or workload JSON."""
    if isinstance(spec, ModelShape):
        return spec
    if str(spec).lower() in PRESETS:
        return PRESETS[str(spec).lower()]
    if Path(spec).exists():
        return ModelShape.from_path(spec)
    raise ValueError(
        f"model: {spec!r} is not a preset, checkpoint directory or config.json; presets: {', '.join(PRESETS)}"
    )


# --------------------------------------------------------------------------- accelerators
@dataclass(frozen=True)
class Accelerator:
    """One chip. Prices are rough on-demand USD list prices: placeholders to override, not quotes."""

    name: str
    hbm_bytes: int
    hbm_bandwidth: float  # bytes/s
    bf16_flops: float  # dense FLOP/s
    pads_head_dim_to: int | None  # TPU lanes are 128 wide, so a 64-wide head dim wastes half its KV
    source: str
    price_per_chip_hour: float = 0.0

    def __post_init__(self) -> None:
        for f in ("hbm_bytes", "hbm_bandwidth", "bf16_flops"):
            _positive(f, getattr(self, f))


_NV = "https://www.nvidia.com/en-us/data-center/"
ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in (
        Accelerator("tpu-v4", 32 * GiB, 1200e9, 275e12, 128, "https://cloud.google.com/tpu/docs/v4", 3.22),
        Accelerator("tpu-v5e", 16 * GiB, 819e9, 197e12, 128, "https://cloud.google.com/tpu/docs/v5e", 1.20),
        Accelerator("tpu-v5p", 95 * GiB, 2765e9, 459e12, 128, "https://cloud.google.com/tpu/docs/v5p", 4.20),
        Accelerator("tpu-v6e", 32 * GiB, 1640e9, 918e12, 128, "https://cloud.google.com/tpu/docs/v6e", 2.70),
        Accelerator("a100-80gb", 80 * GB, 2039e9, 312e12, None, _NV + "a100/ (A100 datasheet, SXM 80GB)", 3.00),
        Accelerator("h100", 80 * GB, 3.35e12, 989e12, None, _NV + "h100/ (H100 datasheet, SXM)", 4.00),
        Accelerator("h200", 141 * GB, 4.8e12, 989e12, None, _NV + "h200/ (H200 datasheet, SXM)", 5.00),
        Accelerator("l4", 24 * GB, 300e9, 121e12, None, _NV + "l4/ (L4 datasheet)", 0.80),
    )
}


def resolve_accelerator(spec: str | Accelerator) -> Accelerator:
    if isinstance(spec, Accelerator):
        return spec
    if str(spec).lower() not in ACCELERATORS:
        raise ValueError(f"accelerator: unknown {spec!r}; choose from {', '.join(ACCELERATORS)}")
    return ACCELERATORS[str(spec).lower()]


# --------------------------------------------------------------------------- sizing
def kv_bytes_per_token(model: ModelShape, kv_dtype: str = "bf16", pad_head_dim_to: int | None = None) -> int:
    """K and V for every layer and KV head: what one token of context costs in HBM while every
    layer holds it (the local layers only within their window: `kv_bytes_per_request`)."""
    return kv_bytes_per_token_per_chip(model, 1, kv_dtype, pad_head_dim_to)


def kv_bytes_per_request(
    model: ModelShape,
    context_len: int,
    kv_dtype: str = "bf16",
    page_size: int | None = None,
    num_chips: int = 1,
    pad_head_dim_to: int | None = None,
) -> int:
    """KV one request of context_len holds (per chip): the full-attention layers every page of
    its context, the sliding-window layers only their window's (`local_kv_tokens`)."""
    tokens = math.ceil(context_len / page_size) * page_size if page_size else context_len
    per_layer = kv_bytes_per_token_per_chip(model, num_chips, kv_dtype, pad_head_dim_to) / model.num_layers
    full = model.num_layers - model.num_local_layers
    return math.ceil(per_layer * (full * tokens + model.num_local_layers * local_kv_tokens(model, tokens, page_size)))


def kv_heads_per_chip(model: ModelShape, num_chips: int) -> int:
    """Tensor parallelism splits KV heads; with more chips than heads each chip still needs one, so heads replicate."""
    return math.ceil(model.num_kv_heads / _positive_int("num_chips", num_chips))


def stored_head_dim(model: ModelShape, pad_head_dim_to: int | None = None) -> int:
    """The head dim the cache really stores: rounded up to the lane width where the hardware pads."""
    if not pad_head_dim_to:
        return model.head_dim
    return math.ceil(model.head_dim / pad_head_dim_to) * pad_head_dim_to


def kv_bytes_per_token_per_chip(
    model: ModelShape, num_chips: int = 1, kv_dtype: str = "bf16", pad_head_dim_to: int | None = None
) -> int:
    """K and V (and an 8-bit cache's per-token-per-head scales) per token on one chip."""
    per_elem = dtype_bytes(kv_dtype, "kv_dtype", weights=False)
    heads = kv_heads_per_chip(model, num_chips)
    per_head = stored_head_dim(model, pad_head_dim_to) * per_elem + KV_SCALE_BYTES.get(kv_dtype, 0)
    return int(2 * model.num_layers * heads * per_head)


def weight_bytes(model: ModelShape, weight_dtype: str = "bf16") -> int:
    return math.ceil(model.num_params * dtype_bytes(weight_dtype, "weight_dtype"))


def _roofline(
    weight_bytes_per_chip: float,
    kv_bytes_per_chip: float,
    flop_params: int,
    batch: int,
    bandwidth: float,
    flops: float,
    num_chips: int,
) -> tuple[float, float]:
    """The one formula every step time here comes from: (memory-bound s, compute-bound s)."""
    return ((weight_bytes_per_chip + kv_bytes_per_chip) / bandwidth, 2.0 * flop_params * batch / (flops * num_chips))


def decode_step_bounds(
    model: ModelShape,
    batch: int,
    kv_tokens_per_request: float,
    bandwidth: float,
    flops: float,
    *,
    num_chips: int = 1,
    weight_dtype: str = "bf16",
    kv_dtype: str = "bf16",
    pad_head_dim_to: int | None = None,
) -> tuple[float, float]:
    """(memory-bound, compute-bound) seconds for one decode step, per chip under tensor parallelism.

    Memory: every streamed weight once plus each request's KV.  Compute: 2 FLOPs per
    streamed parameter per token.  Attention FLOPs are left out: at decode their
    intensity is about heads/kv_heads FLOPs per KV byte, far below any chip's ridge, so
    the KV bytes, already counted, are what they cost.  Communication is ignored.  A mixture of
    experts reads the experts its batch touches (`ModelShape.streamed_params_at`) and multiplies
    each token by its active parameters only.
    """
    w = model.streamed_params_at(batch) * dtype_bytes(weight_dtype, "weight_dtype") / num_chips
    kv = batch * kv_tokens_per_request * kv_bytes_per_token_per_chip(model, num_chips, kv_dtype, pad_head_dim_to)
    return _roofline(w, kv, model.active_streamed_params, batch, bandwidth, flops, num_chips)


def predict_decode_step(
    model: ModelShape,
    batch: int,
    context_len: int,
    bandwidth: float,
    flops: float,
    weight_dtype: str = "fp32",
    kv_dtype: str = "fp32",
    *,
    phases: bool = False,
) -> float:
    """Single-device step time, for comparing with a measured engine step on this host: the
    roofline max(memory, compute) of the whole step (a lower bound), or with `phases` the sum of
    its two phases, each at its own roofline: the projections at max(weight bytes / bandwidth,
    their FLOPs / peak), then the attention at its KV bytes / bandwidth. A step runs them one
    after the other (separate kernels; on a CPU the same cores), so when the projections are
    compute-bound the KV read cannot hide behind them, which the whole-step max assumes. The two
    agree while the projections are memory-bound; the sum is larger once batch makes them
    compute-bound."""
    kw = dict(weight_dtype=weight_dtype, kv_dtype=kv_dtype)
    mem, comp = decode_step_bounds(model, batch, context_len, bandwidth, flops, **kw)
    if not phases:
        return max(mem, comp)
    weights_only, _ = decode_step_bounds(model, batch, 0, bandwidth, flops, **kw)
    return max(weights_only, comp) + (mem - weights_only)


def load_workload(path: str | Path) -> tuple[float, float, int]:
    """(mean prompt_len, mean output_len, request count) of a workload JSON with a ``requests`` list."""
    try:
        reqs = json.loads(Path(path).read_text())["requests"]
        prompts = [int(r["prompt_len"]) for r in reqs]
        outputs = [int(r["output_len"]) for r in reqs]
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"workload: cannot read requests from {str(path)!r}: {e!r}") from None
    if not prompts:
        raise ValueError(f"workload: {str(path)!r} has no requests")
    return sum(prompts) / len(prompts), sum(outputs) / len(outputs), len(prompts)


@dataclass
class Plan:
    """Everything `jaxserve kv-math` reports; byte figures are per chip unless named *_total or whole-model."""

    model: str
    accelerator: str
    num_chips: int
    kv_dtype: str
    weight_dtype: str
    context_len: int
    memory_fraction: float
    page_size: int | None
    price_per_chip_hour: float
    bandwidth: float
    peak_flops: float
    num_params: int
    flop_params: int  # streamed parameters a token multiplies: all but an untied input embedding (MoE: active only)
    weight_bytes_total: int
    weight_bytes_per_chip: int
    streamed_weight_bytes_per_chip: int
    hbm_bytes_per_chip: int
    usable_bytes_per_chip: int
    activation_reserve_bytes: int
    activation_reserve_note: str
    kv_free_bytes_per_chip: int
    kv_heads_per_chip: int
    head_dim_stored: int
    kv_bytes_per_token: int  # whole model, unpadded, unreplicated
    kv_bytes_per_token_per_chip: int  # after padding and replication
    kv_bytes_max_request: int  # one context_len request, whole model
    kv_bytes_max_request_per_chip: int  # after page rounding, padding, replication
    pages_per_request: int | None
    pages_per_chip: int | None
    max_concurrent_requests: int
    fits: bool
    reason: str
    step_time_batch1_s: float = 0.0
    step_memory_bound_s: float = 0.0  # at max(1, max_concurrent_requests), every request at context_len
    step_compute_bound_s: float = 0.0
    step_time_s: float = 0.0
    compute_bound_from_batch: float | None = None  # None: never, each request adds more bytes than its FLOPs hide
    tokens_per_s: float = 0.0
    cost_per_million_output_tokens: float | None = None
    traffic: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    # Mixture of experts (0 for a dense model): parameters per token, and what a step reads of the
    # experts: experts_touched(num_experts, experts_per_token, batch) x expert_bytes_per_chip (one
    # expert of every MoE layer); streamed_weight_bytes_per_chip counts every expert.
    active_params: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    expert_bytes_per_chip: float = 0.0
    # Sliding-window attention (0: none): num_local_layers of num_layers read and keep only the
    # last sliding_window positions' KV
    num_layers: int = 0
    num_local_layers: int = 0
    sliding_window: int = 0

    def kv_read_bytes(self, kv_tokens: float) -> float:
        """KV per chip a decode step reads for one request of kv_tokens: every position in the
        full-attention layers, at most the window's in the sliding ones."""
        per = self.kv_bytes_per_token_per_chip
        if not self.num_local_layers:
            return kv_tokens * per
        full = self.num_layers - self.num_local_layers
        return per / self.num_layers * (full * kv_tokens + self.num_local_layers * min(kv_tokens, self.sliding_window))

    def bounds(self, batch: int, kv_tokens: float | None = None) -> tuple[float, float]:
        """(memory-bound s, compute-bound s) at any batch, each request holding kv_tokens (default context_len)."""
        kv = batch * self.kv_read_bytes(self.context_len if kv_tokens is None else kv_tokens)
        return _roofline(
            self.weight_bytes_read_per_chip(batch),
            kv,
            self.flop_params,
            batch,
            self.bandwidth,
            self.peak_flops,
            self.num_chips,
        )

    def weight_bytes_read_per_chip(self, batch: float) -> float:
        """Weight bytes one decode step of `batch` rows reads per chip: all streamed weights for
        a dense model; for a mixture of experts the shared ones plus the experts it touches."""
        idle = self.num_experts - experts_touched(self.num_experts, self.experts_per_token, batch)
        return self.streamed_weight_bytes_per_chip - idle * self.expert_bytes_per_chip

    def at_batch(self, batch: int, kv_tokens: float | None = None) -> tuple[float, float, float | None]:
        """(step s, tokens/s, USD per million output tokens) at any batch, e.g. for plots."""
        step = max(self.bounds(batch, kv_tokens))
        tps = batch / step
        return step, tps, self.price_per_chip_hour * self.num_chips / (tps * 3600) * 1e6

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_text(self) -> str:
        return format_plan(self)


def plan(
    model: str | ModelShape = "llama-3.1-8b",
    accelerator: str | Accelerator = "h100",
    num_chips: int = 1,
    kv_dtype: str = "bf16",
    weight_dtype: str = "bf16",
    context_len: int = 8192,
    memory_fraction: float = 0.9,
    activation_reserve_bytes: float | None = None,
    page_size: int | None = DEFAULT_PAGE_SIZE,
    price_per_chip_hour: float | None = None,
    mean_prompt: float | None = None,
    mean_output: float | None = None,
    workload: str | Path | None = None,
) -> Plan:
    """Size one deployment. Weights that do not fit are a result (fits=False), not an exception."""
    m, acc = resolve_model(model), resolve_accelerator(accelerator)
    chips, ctx = _positive_int("num_chips", num_chips), _positive_int("context_len", context_len)
    if (
        isinstance(memory_fraction, bool)
        or not isinstance(memory_fraction, (int, float))
        or not 0 < memory_fraction <= 1
    ):
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction!r}")
    page = None if page_size is None else _positive_int("page_size", page_size)
    price = (
        acc.price_per_chip_hour
        if price_per_chip_hour is None
        else _positive("price_per_chip_hour", price_per_chip_hour, allow_zero=True)
    )
    if (mean_prompt is None) != (mean_output is None):
        raise ValueError(
            f"{'mean_output' if mean_output is None else 'mean_prompt'} is missing: "
            "a traffic pattern needs both mean_prompt and mean_output"
        )
    w_total = weight_bytes(m, weight_dtype)
    w_chip = math.ceil(w_total / chips)  # assumes every weight shards evenly; embeddings may replicate in practice
    kv_chip = kv_bytes_per_token_per_chip(m, chips, kv_dtype, acc.pads_head_dim_to)
    usable = int(acc.hbm_bytes * memory_fraction)
    if activation_reserve_bytes is None:
        reserve = int(acc.hbm_bytes * DEFAULT_ACTIVATION_RESERVE_FRACTION)
        reserve_note = f"default: {DEFAULT_ACTIVATION_RESERVE_FRACTION:.0%} of HBM"
    else:
        reserve = int(_positive("activation_reserve_bytes", activation_reserve_bytes, allow_zero=True))
        reserve_note = "given"
    free = usable - w_chip - reserve

    def request_tokens(tokens: float) -> int:  # KV is allocated in whole pages
        return math.ceil(tokens / page) * page if page else math.ceil(tokens)

    pad = acc.pads_head_dim_to
    req_chip = kv_bytes_per_request(m, ctx, kv_dtype, page, chips, pad)  # local layers at their window
    max_req = max(0, free) // req_chip
    if free <= 0:
        reason = (
            f"weights do not fit: {_gb(w_chip)} of weights per chip + {_gb(reserve)} reserve "
            f"> {_gb(usable)} usable ({memory_fraction:g} of {_gb(acc.hbm_bytes)}) on {chips} x {acc.name}"
        )
    elif max_req == 0:
        reason = (
            f"one {ctx}-token request does not fit: it needs {_gb(req_chip)} of KV per chip and "
            f"{_gb(free)} is left after the weights"
        )
    else:
        reason = "ok"
    out = Plan(
        model=m.name,
        accelerator=acc.name,
        num_chips=chips,
        kv_dtype=kv_dtype,
        weight_dtype=weight_dtype,
        context_len=ctx,
        memory_fraction=float(memory_fraction),
        page_size=page,
        price_per_chip_hour=price,
        bandwidth=acc.hbm_bandwidth,
        peak_flops=acc.bf16_flops,
        num_params=m.num_params,
        flop_params=m.active_streamed_params,
        weight_bytes_total=w_total,
        weight_bytes_per_chip=w_chip,
        streamed_weight_bytes_per_chip=math.ceil(m.streamed_params * dtype_bytes(weight_dtype) / chips),
        hbm_bytes_per_chip=acc.hbm_bytes,
        usable_bytes_per_chip=usable,
        activation_reserve_bytes=reserve,
        activation_reserve_note=reserve_note,
        kv_free_bytes_per_chip=free,
        kv_heads_per_chip=kv_heads_per_chip(m, chips),
        head_dim_stored=stored_head_dim(m, acc.pads_head_dim_to),
        kv_bytes_per_token=kv_bytes_per_token(m, kv_dtype),
        kv_bytes_per_token_per_chip=kv_chip,
        kv_bytes_max_request=kv_bytes_per_request(m, ctx, kv_dtype),
        kv_bytes_max_request_per_chip=req_chip,
        pages_per_request=request_tokens(ctx) // page if page else None,
        pages_per_chip=max(0, free) // (page * kv_chip) if page else None,
        max_concurrent_requests=int(max_req),
        fits=max_req > 0,
        reason=reason,
        active_params=m.active_params,
        num_experts=m.num_experts,
        experts_per_token=m.num_experts_per_tok,
        expert_bytes_per_chip=m.num_moe_layers * m.expert_params * dtype_bytes(weight_dtype) / chips,
        num_layers=m.num_layers,
        num_local_layers=m.num_local_layers,
        sliding_window=m.sliding_window,
    )
    out.step_time_batch1_s = out.at_batch(1)[0]
    batch = max(1, out.max_concurrent_requests)
    out.step_memory_bound_s, out.step_compute_bound_s = out.bounds(batch)
    out.step_time_s = max(out.step_memory_bound_s, out.step_compute_bound_s)
    if out.fits:
        _, out.tokens_per_s, out.cost_per_million_output_tokens = out.at_batch(batch)
    out.compute_bound_from_batch = _compute_bound_from_batch(out)
    if ctx > m.max_position_embeddings:
        out.notes.append(f"context {ctx} exceeds the model's max_position_embeddings {m.max_position_embeddings}")
    if m.num_local_layers:
        every = request_tokens(ctx) * kv_chip
        out.notes.append(
            f"sliding window {m.sliding_window}: {m.num_local_layers} of {m.num_layers} layers keep only their "
            f"window's pages, so a {ctx}-token request holds {_gb(req_chip)} of KV per chip instead of "
            f"{_gb(every)} ({_gb(every - req_chip)} saved)"
        )
    source = "given means"
    if workload is not None:
        mean_prompt, mean_output, n = load_workload(workload)
        source = f"{workload} ({n} requests)"
    if mean_prompt is not None:
        p, o = _positive("mean_prompt", mean_prompt), _positive("mean_output", mean_output)
        held = p + o / 2  # a request holds its prompt plus, averaged over its decode, half its output
        conc = int(max(0, free) // kv_bytes_per_request(m, held, kv_dtype, page, chips, pad))
        step, tps, cost = out.at_batch(max(1, conc), kv_tokens=held)
        out.traffic = {
            "source": source,
            "mean_prompt": p,
            "mean_output": o,
            "mean_kv_tokens": held,
            "mean_kv_bytes_per_request": kv_bytes_per_request(m, held, kv_dtype),
            "concurrent_requests": conc,
            "step_time_s": step,
            "tokens_per_s": tps if conc else 0.0,
            "cost_per_million_output_tokens": cost if conc else None,
        }
    return out


def _compute_bound_from_batch(p: Plan) -> float | None:
    """The batch from which a decode step at context_len is compute-bound, None if never.

    memory time = compute time: (W(B) + B*K)/bw = 2*P*B/(F*chips). Dense: W is fixed, so
    B = W / (2*P*bw/(F*chips) - K). A mixture of experts reads more experts as B grows (W(B)
    concave, rising to every expert), so compute - memory is convex in B, negative at 0, and
    crosses zero once when its final slope (the dense denominator) is positive: bisection."""
    denom = 2.0 * p.flop_params * p.bandwidth / (p.peak_flops * p.num_chips) - p.kv_read_bytes(p.context_len)
    if denom <= 0:
        return None
    if not p.num_experts:
        return p.streamed_weight_bytes_per_chip / denom
    lo, hi = 0.0, p.streamed_weight_bytes_per_chip / denom  # at hi even all experts' bytes are hidden
    for _ in range(100):
        mid = (lo + hi) / 2
        mem, comp = p.bounds(mid)
        lo, hi = (mid, hi) if comp < mem else (lo, mid)
    return hi


def max_concurrent_requests(
    model: str | ModelShape,
    context_len: int,
    accelerator: str | Accelerator = "h100",
    num_chips: int = 1,
    kv_dtype: str = "bf16",
    weight_dtype: str = "bf16",
    memory_fraction: float = 0.9,
    activation_reserve_bytes: int | None = None,
    page_size: int | None = None,
) -> int:
    """Requests of context_len tokens that fit at once; 0 when the weights (or one request) do not fit."""
    return plan(
        model,
        accelerator,
        num_chips,
        kv_dtype,
        weight_dtype,
        context_len,
        memory_fraction,
        activation_reserve_bytes,
        page_size,
    ).max_concurrent_requests


# --------------------------------------------------------------------------- output
def _gb(x: float) -> str:
    return f"{x / GB:,.2f} GB"


def _ms(s: float) -> str:
    return f"{s * 1e3:,.2f} ms"


def _usd(x: float | None) -> str:
    return "n/a" if x is None else f"${x:,.3f}"


def format_plan(p: Plan) -> str:
    """A two-column plain-text table: readable in a terminal and pasteable into docs."""
    per = f" per chip (x{p.num_chips})" if p.num_chips > 1 else ""
    rows = [
        ("model", f"{p.model} ({p.num_params / 1e9:.2f}B params)"),
        *(
            [
                (
                    "active params per token",
                    f"{p.active_params / 1e9:.2f}B ({p.experts_per_token} of {p.num_experts} experts + shared parts)",
                ),
                (
                    "weights read per step",
                    f"{_gb(p.weight_bytes_read_per_chip(1))} at batch 1, "
                    f"{_gb(p.weight_bytes_read_per_chip(max(1, p.max_concurrent_requests)))} at batch "
                    f"{max(1, p.max_concurrent_requests)} (expected experts touched: E(1-(1-k/E)^b)), per chip",
                ),
            ]
            if p.num_experts
            else []
        ),
        (
            "accelerator",
            f"{p.num_chips} x {p.accelerator}, {_gb(p.hbm_bytes_per_chip)} "
            f"({p.hbm_bytes_per_chip / GiB:.1f} GiB) HBM, "
            f"{p.bandwidth / 1e12:.3g} TB/s, {p.peak_flops / 1e12:.0f} TFLOP/s bf16 per chip",
        ),
        ("dtypes", f"weights {p.weight_dtype}, KV {p.kv_dtype}"),
        ("context", f"{p.context_len:,} tokens, page size {p.page_size or 'none'}"),
        ("weights", f"{_gb(p.weight_bytes_total)} total, {_gb(p.weight_bytes_per_chip)} per chip"),
        ("usable HBM" + per, f"{_gb(p.usable_bytes_per_chip)} ({p.memory_fraction:g} of HBM)"),
        ("activation reserve" + per, f"{_gb(p.activation_reserve_bytes)} ({p.activation_reserve_note})"),
        ("left for KV" + per, _gb(p.kv_free_bytes_per_chip)),
        (
            "KV per token",
            f"{p.kv_bytes_per_token:,} B ({p.kv_bytes_per_token_per_chip:,} B per chip: "
            f"{p.kv_heads_per_chip} KV head{'s' * (p.kv_heads_per_chip > 1)} "
            f"x head_dim {p.head_dim_stored})",
        ),
        (
            "KV per max-length request",
            f"{_gb(p.kv_bytes_max_request)} ({_gb(p.kv_bytes_max_request_per_chip)} per chip, in pages)",
        ),
        (
            "pages",
            "n/a" if p.page_size is None else f"{p.pages_per_request:,} per request, {p.pages_per_chip:,} per chip",
        ),
        ("max concurrent requests", f"{p.max_concurrent_requests:,}" + ("" if p.fits else f"  ({p.reason})")),
        ("decode step, batch 1", f">= {_ms(p.step_time_batch1_s)}"),
    ]
    if p.fits:
        rows.append(
            (
                f"decode step, batch {p.max_concurrent_requests}",
                f">= {_ms(p.step_time_s)} (memory {_ms(p.step_memory_bound_s)}, compute {_ms(p.step_compute_bound_s)})",
            )
        )
    rows += [
        (
            "compute-bound from batch",
            "never at this context (KV reads grow as fast as FLOPs)"
            if p.compute_bound_from_batch is None
            else f"{p.compute_bound_from_batch:,.0f}",
        ),
        ("tokens/s ceiling at max batch", f"{p.tokens_per_s:,.0f}"),
        (
            "cost per 1M output tokens",
            f"{_usd(p.cost_per_million_output_tokens)} at ${p.price_per_chip_hour:.2f}/chip-hour",
        ),
    ]
    if p.traffic:
        t = p.traffic
        rows += [
            ("traffic", f"{t['source']}: mean prompt {t['mean_prompt']:.1f}, output {t['mean_output']:.1f}"),
            ("  mean KV held per request", f"{t['mean_kv_tokens']:,.1f} tokens, {_gb(t['mean_kv_bytes_per_request'])}"),
            ("  concurrent requests", f"{t['concurrent_requests']:,}"),
            ("  tokens/s ceiling", f"{t['tokens_per_s']:,.0f} (step >= {_ms(t['step_time_s'])})"),
            ("  cost per 1M output tokens", _usd(t["cost_per_million_output_tokens"])),
        ]
    rows += [("note", n) for n in p.notes]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
