"""GGUF checkpoints (llama.cpp's single-file format): config, weights and identity.

A `.gguf` file holds the config as metadata (`llama.block_count`, ...), the tokenizer and chat
template (read by transformers' GGUF tokenizer conversion in engine/tokenizer.py), and the
tensors, often quantized in ggml's block formats. Here the metadata becomes a `ModelConfig`
and each tensor is dequantized with the `gguf` package (ggml's own Python reader) into the
transformers name and layout the loader already knows, so a GGUF goes through the same
conversion cache, int8 quantization and module as a safetensors directory. The family (found
in the registry by `general.architecture`) adds its own metadata keys and tensor names
(`contract.Family.gguf_config`, `gguf_tensors`).

llama.cpp's converter permutes the rows of the Q and K projections of its `llama`
architecture (it interleaves the two rotary halves of each head, for its RoPE kernel);
reading them back undoes that, exactly as transformers does
(`LlamaTensorProcessor._reverse_permute_weights`). Qwen's are written as transformers has them.
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path

import numpy as np

from jaxserve.models import registry
from jaxserve.models.model_config import ModelConfig

log = logging.getLogger("jaxserve.gguf")

# The ggml tensor types read here (the gguf package dequantizes each of them in numpy).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

# GGUF tensor name (after `blk.N.`) -> transformers name (after `model.layers.N.`): llama.cpp's
# names, shared by its architectures; a family adds its own (`Family.gguf_tensors`).
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def is_gguf(path: str | Path) -> bool:
    """A GGUF checkpoint is a file named *.gguf (a checkpoint directory is everything else)."""
    return str(path).lower().endswith(".gguf")


def check_file(path: str | Path) -> None:
    """The errors a user can fix, before the tensors are read."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"model: GGUF file {str(path)!r} does not exist")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"model: {str(path)!r} is not a GGUF file (no 'GGUF' magic at its start)")


def _reader(path: Path):
    from gguf import GGUFReader

    return GGUFReader(str(path))


def hf_architecture(path: str | Path) -> str | None:
    """The transformers architecture jaxserve builds for a GGUF file (its `general.architecture`
    through the registry), None when no family serves it; reads the header only."""
    found = registry.find_gguf(_field(_reader(Path(path)), "general.architecture"))
    return found[0] if found else None


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    value = f.contents()
    return value


def hf_name(gguf_name: str, extra: dict[str, str] | None = None) -> str | None:
    """The transformers tensor name of a GGUF tensor (None for one jaxserve does not use,
    such as llama.cpp's precomputed `rope_freqs`); `extra`: the family's own layer names, which
    take precedence (Gemma's `ffn_norm` is its pre-feed-forward norm, not Llama's second)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk":
        name = (extra or {}).get(parts[2]) or LAYER_NAMES.get(parts[2])
        if name is not None:
            return f"model.layers.{int(parts[1])}.{name}"
    return None


def read_config(path: str | Path) -> ModelConfig:
    """A ModelConfig from the file's metadata (the keys transformers' GGUF config mapping reads);
    ValueError naming an unsupported architecture or tensor type."""
    path = Path(path)
    check_file(path)
    reader = _reader(path)
    arch = _field(reader, "general.architecture")
    found = registry.find_gguf(arch)
    if found is None:
        raise ValueError(
            f"model: GGUF architecture {arch!r} in {path.name} is not supported "
            f"(supported: {', '.join(registry.supported_gguf())})"
        )
    hf_arch, _ = found
    for t in reader.tensors:
        if t.tensor_type.name not in SUPPORTED_TYPES:
            raise ValueError(
                f"model: GGUF tensor {t.name!r} in {path.name} has quantization type {t.tensor_type.name}, "
                f"which is not supported (supported: {', '.join(SUPPORTED_TYPES)})"
            )

    def get(key, default=None):
        v = _field(reader, f"{arch}.{key}", default)
        if v is None:
            raise ValueError(f"model: GGUF metadata key {arch}.{key!r} is missing from {path.name}")
        return v

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    names = {t.name for t in reader.tensors}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _field(reader, f"{arch}.vocab_size") or (len(tokens.data) if tokens is not None else None)
    if vocab is None:
        raise ValueError(
            f"model: GGUF {path.name} gives no vocabulary size ({arch}.vocab_size or tokenizer.ggml.tokens)"
        )
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    fields = dict(
        architecture=hf_arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        # the head width (key_length) where the file says it: Qwen3's differs from hidden / heads
        head_dim=int(get("attention.key_length", get("rope.dimension_count", hidden // heads))),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length")),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        o_bias="blk.0.attn_output.bias" in names,
        eos_token_ids=() if eos is None else (int(eos),),
        bos_token_id=None if bos is None else int(bos),
        name=path.stem,
    )
    fields.update(
        registry.family(hf_arch).gguf_config(lambda key, default=None: _field(reader, f"{arch}.{key}", default))
    )
    return ModelConfig(**fields)


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of a Q or K projection's rows ([n_heads * head_dim, ...]):
    it stored each head's rows as (head_dim/2, 2) pairs; transformers wants (2, head_dim/2)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize(tensor) -> np.ndarray:
    """A GGUF tensor (a `gguf.ReaderTensor`) as float32 in numpy (row-major) order: for a
    weight that is transformers' [out, in]."""
    from gguf.quants import dequantize as ggml_dequantize

    name = tensor.tensor_type.name
    if name not in SUPPORTED_TYPES:
        raise ValueError(f"model: GGUF tensor {tensor.name!r} has unsupported quantization type {name}")
    if name == "F32":
        arr = np.asarray(tensor.data)
    else:
        arr = ggml_dequantize(np.asarray(tensor.data), tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape))  # ggml lists dims innermost first
    return np.asarray(arr, dtype=np.float32).reshape(shape)


def read_tensors(
    path: str | Path, cfg: ModelConfig, wanted: dict[str, tuple[tuple, bool]], dtype
) -> dict[str, np.ndarray]:
    """The tensors the loader wants ({transformers name: (shape, transpose)}), dequantized,
    with Q/K rows unpermuted, transposed where asked and cast to dtype (the same contract as
    the loader's safetensors reader)."""
    path = Path(path)
    reader = _reader(path)
    family = registry.family(cfg.architecture)
    extra_names = dict(family.gguf_tensors)
    out: dict[str, np.ndarray] = {}
    t0 = time.time()
    for t in reader.tensors:
        name = hf_name(t.name, extra_names)
        if name not in wanted:
            continue
        arr = dequantize(t)
        if family.gguf_tensor_value is not None:
            arr = family.gguf_tensor_value(name, arr)
        if family.gguf_unpermute_qk:
            if name.endswith("q_proj.weight") or name.endswith("q_proj.bias"):
                arr = unpermute_qk(arr, cfg.num_heads)
            elif name.endswith("k_proj.weight") or name.endswith("k_proj.bias"):
                arr = unpermute_qk(arr, cfg.num_kv_heads)
        shape, transpose = wanted[name]
        if transpose:
            arr = arr.T
        if tuple(arr.shape) != tuple(shape):
            raise ValueError(f"{path.name}: tensor {t.name!r} has shape {arr.shape}, expected {tuple(shape)}")
        out[name] = np.ascontiguousarray(arr.astype(dtype))
    missing = [n for n in wanted if n not in out]
    if missing:
        raise ValueError(
            f"model: tensor {missing[0]!r} is missing from the GGUF file {str(path)!r}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    log.info("dequantized %d GGUF tensors from %s in %.1fs", len(out), path.name, time.time() - t0)
    return out


def fingerprint_update(h: "hashlib._Hash", path: Path) -> None:
    """Feed a cheap identity of the file into h: its size, its first 16 MiB (the metadata and
    tensor table of any common model, and the first tensors) and 1 MiB from the middle and the
    end. Parsing the header instead costs seconds (a vocabulary is tens of thousands of strings)."""
    size = path.stat().st_size
    h.update(f"{path.name}:{size}".encode())
    with open(path, "rb") as f:
        h.update(f.read(16 << 20))
        for off in (size // 2, max(0, size - (1 << 20))):
            f.seek(off)
            h.update(f.read(1 << 20))
