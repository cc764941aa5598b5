"""An EAGLE-style draft head: one decoder layer that drafts from the target's own features.

A separate small draft model guesses the next tokens from the tokens alone; a head that reads
the target's last hidden state already knows what the target knows, so one layer drafts as
well as a much larger model (EAGLE, Li et al. 2024; vLLM, SGLang and TensorRT-LLM ship it).

At token position j the head reads the target's feature at j - 1 (its final-norm hidden
state: what the target's vocabulary projection reads) and the embedding of token j, and
predicts the feature at j; its vocabulary projection turns that into a guess at token j + 1:

    x   = fc([embed(token_j), feature_{j-1}])     # [2H] -> [H]
    g_j = DecoderLayer(x)                         # its own attention over its own paged KV
    logits_j = lm_head(g_j)                       # the target's LM head rows of the draft vocab

Drafting k tokens feeds g_j back as the next feature (the target's is not known yet). The
vocabulary projection covers only the `draft_vocab_size` tokens the target emits most (their
target ids in `d2t`, EAGLE-3's reduced draft vocabulary): on a 135M target the full 49k-row
projection would cost a fifth of a target step per drafted token. Acceptance stays lossless
whatever the head proposes (runner/speculative.py); the head only decides how often it wins.

The embedding is the target's own array (shared, not copied). The target's features live in
pages beside the head's KV (same page ids as every other cache), so prefix caching, page
copies and preemption treat them like KV. Checkpoint: a directory with `config.json`
(`"architecture": "EagleHead"`, the layer's shape, `draft_vocab_size`, `target`) and
`model.safetensors` (transformers-style names, [out, in] weights; `d2t` int32).
scripts/train_eagle.py trains one; docs/default-model.md says how, and why none ships yet.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.models import linear
from jaxserve.models.linear import Linear
from jaxserve.models.llama import DecoderLayer, rope_tables
from jaxserve.models.model_config import ModelConfig

ARCHITECTURE = "EagleHead"


class Buffer(nnx.Variable):
    """A fixed array of the module that is not trained (the draft-to-target token map)."""


def is_eagle_dir(path: str | Path) -> bool:
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return False
    try:
        return json.loads(cfg.read_text()).get("architecture") == ARCHITECTURE
    except (OSError, ValueError):
        return False


@dataclasses.dataclass(frozen=True)
class EagleConfig:
    """The head's shape: its decoder layer is shaped like one of the target's."""

    layer: ModelConfig  # the target's config with num_layers=1 (the head's KV pool takes it)
    draft_vocab_size: int
    target: str = ""  # the target it was trained for (a name, checked loosely)

    @classmethod
    def for_target(cls, target: ModelConfig, draft_vocab_size: int, intermediate_size: int | None = None):
        layer = dataclasses.replace(
            target,
            num_layers=1,
            intermediate_size=intermediate_size or target.intermediate_size,
            architecture=ARCHITECTURE,
            tie_word_embeddings=False,
        )
        return cls(layer, draft_vocab_size, target.name)

    def to_json(self) -> dict:
        c = self.layer
        return {
            "architecture": ARCHITECTURE,
            "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "num_heads": c.num_heads,
            "num_kv_heads": c.num_kv_heads,
            "head_dim": c.head_dim,
            "draft_vocab_size": self.draft_vocab_size,
            "target": self.target,
        }

    @classmethod
    def from_json(cls, d: dict, target: ModelConfig) -> "EagleConfig":
        """The head's config against the target it drafts for; ValueError naming a mismatch."""
        for key, want in (
            ("hidden_size", target.hidden_size),
            ("num_heads", target.num_heads),
            ("num_kv_heads", target.num_kv_heads),
            ("head_dim", target.head_dim),
        ):
            if d.get(key) != want:
                raise ValueError(
                    f"speculative_model: the EAGLE head's {key} ({d.get(key)}) differs from the target's ({want})"
                )
        return cls.for_target(target, int(d["draft_vocab_size"]), int(d["intermediate_size"]))


class EagleHead(nnx.Module):
    def __init__(self, cfg: EagleConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None, init_std: float = 0.02):
        rngs = rngs or nnx.Rngs(0)
        c = cfg.layer
        h = c.hidden_size
        self.cfg = cfg
        self.dtype = dtype
        self.embed_tokens = nnx.Embed(
            c.vocab_size, h, dtype=dtype, param_dtype=dtype, rngs=rngs, embedding_init=nnx.initializers.normal(init_std)
        )
        self.fc = Linear(2 * h, h, bias=False, dtype=dtype, rngs=rngs, std=init_std)
        self.layer = DecoderLayer(c, dtype, rngs, init_std)
        self.lm_head = Linear(h, cfg.draft_vocab_size, bias=False, dtype=dtype, rngs=rngs, std=init_std)
        self.d2t = Buffer(jnp.arange(cfg.draft_vocab_size, dtype=jnp.int32))

    def __call__(self, tokens, positions, features, kv_cache=None, meta=None, attn_fn=None, num_live_tokens=None):
        """tokens/positions [B, T], features [B, T, H] (the feature at each token's previous
        position). Without a cache: dense causal attention (training); with one (the head's
        single layer's pages), `meta` as the target's forward takes it. Returns (g [B, T, H],
        the new cache or None): g is the predicted feature; `logits(g)` drafts from it."""
        x = self.embed_tokens(tokens)
        x = self.fc(jnp.concatenate([x, features.astype(x.dtype)], axis=-1))
        rope_cs = rope_tables(positions, jnp.asarray(self.cfg.layer.inv_freq()), x.dtype)
        with linear.live_rows(num_live_tokens):
            x, cache = self.layer(x, rope_cs, kv_cache, meta, attn_fn)
        return x, cache

    def untie_lm_head(self) -> None:
        """Nothing to untie: the head's projection is its own (the runner asks every model)."""

    def logits(self, g):
        """Logits over the draft vocabulary [..., draft_vocab_size] (float32); d2t maps an
        index to the target's token id."""
        return self.lm_head(g).astype(jnp.float32)


# -- checkpoint --------------------------------------------------------------------------
def _names(head: EagleHead) -> dict[str, tuple]:
    """transformers-style tensor name -> (the nnx state path, transpose?) of every stored array
    (the embedding is the target's, not stored)."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(head)):
        p = tuple(str(x) for x in path)
        if p[0] == "embed_tokens":
            continue
        leaf = p[-1]
        if leaf == "kernel":
            out[".".join(p[:-1]) + ".weight"] = (path, True)
        else:
            out[".".join(p[:-1] + (leaf,)) if leaf != "value" else ".".join(p[:-1])] = (path, False)
    return out


def save_head(head: EagleHead, path: str | Path) -> None:
    """Write the head as config.json + model.safetensors ([out, in] weights, float32 or as stored)."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    flat = dict(nnx.to_flat_state(nnx.state(head)))
    arrays = {}
    for name, (p, transpose) in _names(head).items():
        a = np.asarray(flat[p].get_value())
        arrays[name] = np.ascontiguousarray(a.T if transpose else a)
    save_file(arrays, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(head.cfg.to_json(), indent=1) + "\n")


def load_head(path: str | Path, target: nnx.Module, target_cfg: ModelConfig, dtype) -> tuple[EagleHead, ModelConfig]:
    """The head at `path` for `target` (its embedding shared), in `dtype`. Returns (head, the
    head's layer config: the config its KV pool is built from)."""
    from safetensors.numpy import load_file

    path = Path(path)
    cfg = EagleConfig.from_json(json.loads((path / "config.json").read_text()), target_cfg)
    arrays = load_file(str(path / "model.safetensors"))
    head = nnx.eval_shape(lambda: EagleHead(cfg, dtype=dtype))
    graphdef, state = nnx.split(head)
    flat = dict(nnx.to_flat_state(state))
    leaves = []
    for name, (p, transpose) in _names(head).items():
        if name not in arrays:
            raise ValueError(f"speculative_model: {path} lacks the tensor {name!r}")
        a = arrays[name].T if transpose else arrays[name]
        var = flat[p]
        if tuple(a.shape) != tuple(var.shape):
            raise ValueError(f"speculative_model: {name} has shape {a.shape}, the head wants {tuple(var.shape)}")
        leaves.append((p, var.replace(jnp.asarray(a, jnp.int32 if name == "d2t" else dtype))))
    emb = target.input_embedding()
    d2t = np.asarray(arrays["d2t"])
    if d2t.min() < 0 or d2t.max() >= target_cfg.vocab_size:
        raise ValueError(f"speculative_model: the head's d2t holds ids outside the target's vocabulary ({path})")
    emb = emb if emb.dtype == dtype else emb.astype(dtype)  # the same array where the dtypes agree
    leaves.append((("embed_tokens", "embedding"), flat[("embed_tokens", "embedding")].replace(emb)))
    head = nnx.merge(graphdef, nnx.from_flat_state(leaves))
    return head, cfg.layer


def prev_feature_slots(positions, query_start_loc, block_tables, page_size: int):
    """For every flat token [N], the KV slot of its previous position in its row's pages, and
    whether it has one (position 0 has none; padding tokens read the dummy page)."""
    n = positions.shape[0]
    row = jnp.searchsorted(query_start_loc, jnp.arange(n), side="right") - 1
    row = jnp.clip(row, 0, block_tables.shape[0] - 1)
    prev = jnp.maximum(positions - 1, 0)
    page = block_tables[row, jnp.minimum(prev // page_size, block_tables.shape[1] - 1)]
    return page * page_size + prev % page_size, positions > 0


def gather_features(features, slots, valid):
    """features [P, page_size, H] at flat slots -> [N, H], zero where not valid."""
    flat = features.reshape(-1, features.shape[-1])
    return jnp.where(valid[:, None], flat[slots], 0).astype(features.dtype)


def write_features(features, hidden, slot_mapping):
    """features [P, page_size, H] with hidden [N, H] written at the flat slots."""
    p, ps, h = features.shape
    return features.reshape(-1, h).at[slot_mapping].set(hidden.astype(features.dtype)).reshape(p, ps, h)


def empty_features(num_pages: int, page_size: int, hidden: int, dtype) -> jax.Array:
    return jnp.zeros((num_pages, page_size, hidden), dtype)
