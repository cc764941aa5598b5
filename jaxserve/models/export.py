"""Write an nnx Llama model as a Hugging Face checkpoint directory.

The inverse of `jaxserve.models.loader.load_model`: config.json (through
`transformers.LlamaConfig.save_pretrained`), model.safetensors with transformers' tensor
names and [out, in] weight layout, and optionally the tokenizer files, so that both
`load_model(dir)` and `transformers.AutoModelForCausalLM.from_pretrained(dir)` read it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxserve.models.loader import _hf_name
from jaxserve.models.model_config import ModelConfig

SPECIAL_TOKENS = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}


def hf_state_dict(model: nnx.Module, dtype=np.float32) -> dict[str, np.ndarray]:
    """The model's parameters under transformers' names, kernels transposed to [out, in]."""
    _, state = nnx.split(model, nnx.Param)
    out: dict[str, np.ndarray] = {}
    for path, var in nnx.to_flat_state(state):
        name, transpose = _hf_name(path)
        arr = np.asarray(jax.device_get(var[...]))
        if transpose:
            arr = arr.T
        if name in out:
            raise ValueError(f"export: two parameters map to {name!r}")
        out[name] = np.ascontiguousarray(arr.astype(dtype))
    return out


def hf_config(cfg: ModelConfig, dtype: str = "float32", pad_token_id: int | None = None):
    """A transformers.LlamaConfig equivalent to `cfg` (plain Llama only)."""
    from transformers import LlamaConfig

    if cfg.architecture != "LlamaForCausalLM":
        raise ValueError(f"export: only LlamaForCausalLM is supported, not {cfg.architecture!r}")
    if cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias or cfg.sliding_window:
        raise ValueError("export: biases and sliding windows are not supported")
    rope = {"rope_type": "default", **dict(cfg.rope_scaling), "rope_theta": float(cfg.rope_theta)}
    eos = list(cfg.eos_token_ids)
    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters=rope,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=(eos[0] if len(eos) == 1 else (eos or None)),
        pad_token_id=pad_token_id,
        dtype=dtype,
    )


def wrap_tokenizer(tok: Any, model_max_length: int | None = None):
    """A transformers fast tokenizer from a `tokenizers.Tokenizer`, a directory, or a
    transformers tokenizer (returned as is)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if hasattr(tok, "save_pretrained"):
        return tok
    if isinstance(tok, (str, Path)):
        return AutoTokenizer.from_pretrained(str(tok))
    from tokenizers import Tokenizer

    if not isinstance(tok, Tokenizer):
        raise TypeError(f"export: cannot save a tokenizer of type {type(tok).__name__}")
    specials = {k: v for k, v in SPECIAL_TOKENS.items() if tok.token_to_id(v) is not None}
    kwargs = {"model_max_length": model_max_length} if model_max_length else {}
    return PreTrainedTokenizerFast(tokenizer_object=tok, **specials, **kwargs)


def save_hf_checkpoint(
    model: nnx.Module, cfg: ModelConfig, out_dir: str | Path, tokenizer_dir_or_obj: Any = None, dtype=np.float32
) -> Path:
    """Write config.json, model.safetensors and (if given) the tokenizer files to out_dir.

    Tied embeddings write no lm_head.weight, as transformers does."""
    from safetensors.numpy import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = None
    pad_id = None
    if tokenizer_dir_or_obj is not None:
        tokenizer = wrap_tokenizer(tokenizer_dir_or_obj, cfg.max_position_embeddings)
        pad_id = tokenizer.pad_token_id
    hf_config(cfg, np.dtype(dtype).name, pad_id).save_pretrained(str(out))
    tensors = hf_state_dict(model, dtype)
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    weights = out / "model.safetensors"
    save_file(tensors, str(weights), metadata={"format": "pt"})
    weights.chmod(0o644)  # safetensors creates it 0600
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return out
