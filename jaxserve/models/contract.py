"""The model contract: what the runner calls, and what a family module gives the registry.

A model family (Llama, Qwen3, Qwen3-MoE, ...) is one module. It exports a `Family`: the
decoder class (a `CausalLM`), how its config.json and its GGUF metadata map onto
`ModelConfig`, how its parameters are named in a Hugging Face checkpoint and in a GGUF file,
and how its projections split across chips. Everything else (the loader, the conversion
cache, int8 quantization, tensor parallelism, the runner) reads those and nothing
family-specific, so a new family is its own module plus one line in `registry.FAMILIES`.

Plain Python (no jax): the registry and the config parser import it without a device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

# The mesh axis that expert parallelism splits a mixture-of-experts layer's experts over (beside
# tensor parallelism's "tp"); the models name it in their shard_map, parallel/sharding.py places
# the stacked expert weights on it.
EXPERT_AXIS = "expert"

# A config reader: key -> value, or `default` when the key is absent (config.json keys through
# a transformers config or a dict; GGUF keys without their `<arch>.` prefix).
Getter = Callable[..., Any]


@runtime_checkable
class CausalLM(Protocol):
    """What the runner, the speculative drafter and the EAGLE head ask of a decoder.

    `__call__(tokens, positions, kv_cache=None, meta=None, attn_fn=None, *, logits_index=None,
    token_index=None, num_live_tokens=None, return_hidden=False, num_live_logits=None)` ->
    (logits float32, new cache[, final-norm hidden states]): tokens/positions [B, T]; without a
    cache dense causal attention, with one `meta` (pallas_kernels.reference.RaggedMetadata)
    describes the B*T tokens as a ragged batch for `attn_fn` (the attention backend's forward).
    The KV cache is one tuple of page arrays per layer, passed in and returned, never state."""

    def __call__(self, tokens, positions, kv_cache=None, meta=None, attn_fn=None, **kw) -> tuple: ...

    def untie_lm_head(self) -> None:
        """Give a tied model a vocabulary projection of its own (the CPU runner packs it like
        every projection); a no-op where there is nothing to untie."""

    def input_embedding(self) -> Any:
        """The token embedding table [V, H] (a draft or EAGLE head shares the target's)."""


@runtime_checkable
class MeshAware(Protocol):
    """A layer that runs part of its work per device itself (`jax.shard_map`), so it must know
    the mesh when it is traced: the runner hands it over before splitting the model
    (`parallel.sharding.bind_mesh`). A Qwen3-MoE layer uses it for expert parallelism."""

    def use_mesh(self, mesh: Any) -> None: ...


@dataclasses.dataclass(frozen=True)
class CheckpointTensor:
    """Where a parameter lives in a Hugging Face checkpoint: one tensor name, or several
    (one per expert) stacked along a new leading axis (`stacked_as`: the name the
    converted-weight cache keys the stack by); `transpose`: each is stored [out, in] and the
    parameter is [in, out]."""

    names: tuple[str, ...]
    transpose: bool
    stacked_as: str | None = None

    @property
    def key(self) -> str:
        return self.stacked_as or self.names[0]


def mirrored_name(path: tuple, cfg: Any = None) -> CheckpointTensor:
    """The transformers tensor of an nnx parameter path when the module's attribute names
    mirror transformers' (every family here): `model.` + the path, a Linear's kernel as
    `weight` stored transposed, `lm_head` at the top level."""
    from jaxserve.models.linear import checkpoint_tensor

    parts = [str(p) for p in path]
    leaf = parts[-1]
    if parts[0] == "embed_tokens":
        return CheckpointTensor(("model.embed_tokens.weight",), False)
    prefix = "" if parts[0] == "lm_head" else "model."
    if leaf in ("kernel", "bias"):  # a Linear: it knows how the checkpoint stores it
        suffix, transpose = checkpoint_tensor(leaf)
        return CheckpointTensor((prefix + ".".join(parts[:-1]) + "." + suffix,), transpose)
    return CheckpointTensor((prefix + ".".join(parts),), False)


def no_extra_fields(get: Getter) -> dict:
    return {}


@dataclasses.dataclass(frozen=True)
class Family:
    """Everything family-specific about a checkpoint, exported by the family's module.

    model: the decoder class, built as `model(cfg, dtype=..., rngs=...)`, a `CausalLM`.
    tp_layout: projection attribute name -> linear.COLUMN or linear.ROW (tensor parallelism);
        parameters of modules not named here are replicated.
    hf_config: config.json reader -> the ModelConfig fields this family sets beyond the shared
        ones (`model_config.ModelConfig.from_hf` reads those), e.g. {"qk_norm": True}.
    gguf_config: the same from a GGUF's metadata (keys without the `<arch>.` prefix).
    gguf_tensors: GGUF tensor name after `blk.N.` -> transformers name after `model.layers.N.`,
        beyond llama.cpp's names every family shares (`gguf.LAYER_NAMES`).
    gguf_unpermute_qk: llama.cpp's converter permuted the Q/K rows (its `llama` architecture
        only; Qwen's converters write them as transformers does).
    checkpoint_tensor: (an nnx parameter path, the ModelConfig) -> its transformers tensor(s)
        (`mirrored_name` where the module's names mirror transformers'; a family with stacked
        experts maps those to the per-expert tensors).
    gguf_tensor_value: (transformers name, float32 array) -> the values transformers holds, for
        a family whose GGUF converter changed them (Gemma: llama.cpp folds the +1 of its
        `x * (1 + w)` norms into the weights); None: as stored.
    chat_template: the Jinja chat template for a checkpoint that ships none (llama.cpp, too,
        falls back to its built-in template of the architecture); None: chat is refused.
    """

    model: type
    tp_layout: Mapping[str, str]
    hf_config: Callable[[Getter], dict] = no_extra_fields
    gguf_config: Callable[[Getter], dict] = no_extra_fields
    gguf_tensors: Mapping[str, str] = dataclasses.field(default_factory=dict)
    gguf_unpermute_qk: bool = False
    checkpoint_tensor: Callable[[tuple, Any], CheckpointTensor] = mirrored_name
    gguf_tensor_value: Callable[[str, Any], Any] | None = None
    chat_template: str | None = None
