"""Model configuration read from a Hugging Face checkpoint's config.json.

The config is a frozen, hashable dataclass so that it can be a static argument of
jitted functions: every field that changes array shapes must live here.

One parser: the fields every decoder has are read here (the shape through kv-math's
`ModelShape.from_hf_config`, the same reader `jaxserve kv-math` uses), the family's own
(biases, q/k norms, experts) by its `contract.Family.hf_config`, the family found in the
registry by the config's `architectures` or `model_type`. GGUF metadata goes through the same
steps in `gguf.read_config`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.kv_math import ModelShape
from jaxserve.models import registry


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    # Extra rope parameters as sorted (key, value) pairs, hashable; () means plain RoPE.
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    # Sliding-window attention: each query sees its last `sliding_window` positions in the layers
    # `layer_types` marks "sliding_attention" (every layer when layer_types is empty: Mistral);
    # "full_attention" layers see the whole context.
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    name: str = ""
    # Qwen3: RMSNorm over each head of q and k, before RoPE
    qk_norm: bool = False
    # Mixture of experts (Qwen3-MoE): the layers whose MLP is a routed set of experts
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    sparse_layers: tuple[int, ...] = ()
    # Per-layer attention kind (transformers' `layer_types`), read where a window applies
    layer_types: tuple[str, ...] = ()
    # Gemma 3: the sliding layers' RoPE base (None: rope_theta, and one set of tables for all)
    rope_local_theta: float | None = None
    # Gemma 3: attention scale query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5)
    query_pre_attn_scalar: float | None = None
    # Hidden-size norms per block (Gemma 3: 4, before and after attention and the MLP)
    block_norms: int = 2

    @property
    def rope_type(self) -> str:
        return dict(self.rope_scaling).get("rope_type", "default")

    @property
    def max_context(self) -> int:
        """Longest sequence served: the position embeddings' (a sliding window is masked by
        every attention backend, so it no longer caps the context)."""
        return self.max_position_embeddings

    def is_sliding(self, layer: int) -> bool:
        """Layer `layer` attends through the sliding window."""
        if not self.sliding_window:
            return False
        return not self.layer_types or self.layer_types[layer] == "sliding_attention"

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (keys per query), None for full attention."""
        return int(self.sliding_window) if self.is_sliding(layer) else None

    @property
    def local_window(self) -> int | None:
        """The window W of the sliding layers (they all share it: the "local" KV group, whose
        pages the KV manager frees once they fall out of it), None when no layer slides."""
        if not any(self.is_sliding(i) for i in range(self.num_layers)):
            return None
        return int(self.sliding_window)

    def kv_groups(self) -> dict[str, tuple[int, ...]]:
        """The per-layer KV spec as groups of layers with one page pool each: "full" (full
        attention: every page of the context) and "local" (sliding window W: only the pages
        of the last W positions; absent when no layer slides)."""
        local = tuple(i for i in range(self.num_layers) if self.is_sliding(i))
        full = tuple(i for i in range(self.num_layers) if not self.is_sliding(i))
        return {"full": full, "local": local} if local else {"full": full}

    @property
    def attn_scale(self) -> float:
        """What q.k is multiplied by before the softmax."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def shape(self) -> ModelShape:
        """The shape kv-math sizes and times (bytes per token, weights streamed per step, the
        experts a step reads). A mixture of experts whose layers are all dense is a dense shape."""
        moe = {}
        if self.sparse_layers:
            moe = dict(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                num_moe_layers=len(self.sparse_layers),
            )
        return ModelShape(
            name=self.name or "custom",
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings,
            qk_norm=self.qk_norm,
            block_norms=self.block_norms,
            **moe,
            **self._sliding_shape(),
        )

    def _sliding_shape(self) -> dict:
        """kv-math's sliding_window and num_local_layers (the local KV group's)."""
        local = len(self.kv_groups().get("local", ()))
        return {"sliding_window": int(self.sliding_window), "num_local_layers": local} if local else {}

    def num_params(self) -> int:
        """Every parameter, as kv-math counts the same shape (Qwen2's q/k/v biases left out)."""
        return self.shape().num_params

    def inv_freq(self, local: bool = False) -> np.ndarray:
        """RoPE inverse frequencies in float32, computed exactly as transformers does; local:
        those of the sliding layers of a model with a base of their own (Gemma 3: plain RoPE at
        rope_local_theta, no scaling)."""
        dim = self.head_dim
        theta = self.rope_local_theta if local and self.rope_local_theta else self.rope_theta
        inv = (1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))).astype(np.float32)
        params = {} if local and self.rope_local_theta else dict(self.rope_scaling)
        rtype = params.get("rope_type", "default")
        if rtype == "default":
            return inv
        if rtype == "linear":  # positions divided by the factor (Gemma 3's larger models)
            return (inv / np.float32(params["factor"])).astype(np.float32)
        if rtype == "llama3":
            factor = float(params["factor"])
            low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
            old_ctx = float(params["original_max_position_embeddings"])
            low_wl, high_wl = old_ctx / low, old_ctx / high
            wavelen = (2 * math.pi / inv).astype(np.float32)
            inv_l = np.where(wavelen > low_wl, inv / factor, inv).astype(np.float32)
            smooth = ((old_ctx / wavelen - low) / (high - low)).astype(np.float32)
            smoothed = ((1 - smooth) * inv_l / factor + smooth * inv_l).astype(np.float32)
            medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
            return np.where(medium, smoothed, inv_l).astype(np.float32)
        raise ValueError(f"rope_parameters.rope_type={rtype!r} is not supported (supported: default, linear, llama3)")

    @classmethod
    def from_hf(cls, hf: Any, name: str = "") -> "ModelConfig":
        """From a transformers PretrainedConfig or a config.json dict (transformers 5 keeps
        rope_theta in rope_parameters); ValueError naming an architecture no family serves."""
        get = _getter(hf)
        archs = list(get("architectures") or [])
        model_type = get("model_type", "")
        found = registry.find_hf(archs, model_type)
        if found is None:
            raise ValueError(
                f"config.json: architecture {archs or model_type!r} is not implemented by jaxserve "
                f"(supported: {', '.join(registry.supported())})"
            )
        arch, _ = found
        shape = ModelShape.from_hf_config(hf)
        rope = dict(get("rope_parameters") or {})
        theta = rope.pop("rope_theta", get("rope_theta", 10000.0))
        if rope.get("rope_type", "default") == "default":
            rope = {}
        eos = get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        attention_bias = bool(get("attention_bias", False))
        fields = dict(
            architecture=arch,
            vocab_size=shape.vocab_size,
            hidden_size=shape.hidden_size,
            intermediate_size=shape.intermediate_size,
            num_layers=shape.num_layers,
            num_heads=shape.num_heads,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            rms_norm_eps=float(_required(get, "rms_norm_eps")),
            rope_theta=float(theta),
            max_position_embeddings=shape.max_position_embeddings,
            tie_word_embeddings=shape.tie_word_embeddings,
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(get("mlp_bias", False)),
            rope_scaling=tuple(sorted(rope.items())),
            sliding_window=get("sliding_window") if get("use_sliding_window", False) else None,
            layer_types=tuple(get("layer_types") or ()),
            eos_token_ids=eos_ids,
            bos_token_id=get("bos_token_id"),
            name=name,
        )
        fields.update(registry.family(arch).hf_config(get))
        return cls(**fields)

    @staticmethod
    def check_dir(path: str | Path) -> None:
        """The errors a user can fix, before anything is read with transformers."""
        path = Path(path)
        if not path.is_dir():
            raise ValueError(f"model: checkpoint directory {str(path)!r} does not exist")
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ValueError(f"model: {str(cfg_file)!r} is missing (a Hugging Face checkpoint needs config.json)")
        raw = json.loads(cfg_file.read_text())
        archs = raw.get("architectures") or []
        if registry.find_hf(archs, raw.get("model_type")) is None:
            raise ValueError(
                f"{cfg_file}: architecture {archs or raw.get('model_type')!r} is not implemented by jaxserve "
                f"(supported: {', '.join(registry.supported())})"
            )

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        cls.check_dir(path)
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(str(path))
        return cls.from_hf(hf, name=Path(path).name)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "ModelConfig":
        """Inverse of to_json (JSON turns the tuples into lists)."""
        d = dict(d)
        d["rope_scaling"] = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in d["rope_scaling"])
        d["eos_token_ids"] = tuple(d["eos_token_ids"])
        d["sparse_layers"] = tuple(d.get("sparse_layers", ()))
        d["layer_types"] = tuple(d.get("layer_types", ()))
        return cls(**d)


def _getter(cfg: Any):
    """key -> value of a transformers config object or a config.json dict."""
    if isinstance(cfg, dict):
        return cfg.get
    return lambda key, default=None: getattr(cfg, key, default)


def _required(get, key: str):
    value = get(key)
    if value is None:
        raise ValueError(f"model config: missing {key!r}")
    return value
