"""Model configuration read from a Hugging Face checkpoint's config.json.

The config is a frozen, hashable dataclass so that it can be a static argument of
jitted functions: every field that changes array shapes must live here.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.kv_math import ModelShape

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


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
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    name: str = ""

    @property
    def rope_type(self) -> str:
        return dict(self.rope_scaling).get("rope_type", "default")

    @property
    def max_context(self) -> int:
        """Longest sequence served: a sliding window would need masking we do not do,
        so a model with one is served up to its window only."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    def shape(self) -> ModelShape:
        """The shape kv-math sizes and times (bytes per token, weights streamed per step)."""
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
        )

    def num_params(self) -> int:
        d, h, kv, hd, f = self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim, self.intermediate_size
        attn = d * h * hd * 2 + d * kv * hd * 2
        per_layer = attn + 3 * d * f + 2 * d
        emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + d

    def inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies in float32, computed exactly as transformers does."""
        dim = self.head_dim
        inv = (1.0 / (self.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))).astype(
            np.float32
        )
        params = dict(self.rope_scaling)
        rtype = params.get("rope_type", "default")
        if rtype == "default":
            return inv
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
        raise ValueError(f"rope_parameters.rope_type={rtype!r} is not supported (supported: default, llama3)")

    @classmethod
    def from_hf(cls, hf: Any, name: str = "") -> "ModelConfig":
        """From a transformers PretrainedConfig (transformers 5 keeps rope_theta in rope_parameters)."""
        archs = list(getattr(hf, "architectures", None) or [])
        model_type = getattr(hf, "model_type", "")
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
            arch = by_type.get(model_type)
        if arch is None:
            raise ValueError(
                f"config.json: architecture {archs or model_type!r} is not implemented by jaxserve "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        rope = dict(getattr(hf, "rope_parameters", None) or {})
        theta = rope.pop("rope_theta", getattr(hf, "rope_theta", 10000.0))
        rope_type = rope.get("rope_type", "default")
        if rope_type == "default":
            rope = {}
        heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        attention_bias = bool(getattr(hf, "attention_bias", False))
        sliding = None
        if family == "mistral" or getattr(hf, "use_sliding_window", False):
            sliding = getattr(hf, "sliding_window", None)
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.rms_norm_eps),
            rope_theta=float(theta),
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=True if family == "qwen2" else attention_bias,
            o_bias=False if family == "qwen2" else attention_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            rope_scaling=tuple(sorted(rope.items())),
            sliding_window=sliding,
            eos_token_ids=eos_ids,
            bos_token_id=getattr(hf, "bos_token_id", None),
            name=name,
        )

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
        if not any(a in SUPPORTED_ARCHITECTURES for a in archs) and raw.get("model_type") not in (
            "llama",
            "mistral",
            "qwen2",
        ):
            raise ValueError(
                f"{cfg_file}: architecture {archs or raw.get('model_type')!r} is not implemented by jaxserve "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
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
        return cls(**d)
