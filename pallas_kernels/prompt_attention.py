"""Fresh prompts through a dense fused attention (cuDNN on a GPU), the rest through pages.

A fresh prompt (a row with no cached prefix: its keys are exactly this step's own tokens) does
not need the page pool at all: its K/V are the step's k and v, contiguous in the flat token
array. cuDNN's fused flash attention is a tuned prefill kernel; the ragged paged kernel's
prefill blocks are not (docs/kernels.md, "H200 results": 6.5% of the chip). So a step is split
in two, inside the one fixed-shape jitted step, without Python branching on traced values:

- `split(md)` (once per step): which rows are fresh (`seq_lens[r]` equals the row's query
  count), a stable order that puts their tokens first, how many there are, each token's row.
  The paged kernel gets the same metadata with the fresh rows' `seq_lens` set to 0: their
  tokens see no page, so the kernel reads nothing for them and returns zeros.
- `dense(q, k, v, plan, ...)` (every layer): the fresh tokens gathered to the front of one
  sequence of N, `jax.nn.dot_product_attention` over it with `query_seq_lengths` =
  `key_value_seq_lengths` = the fresh count (cuDNN's padding mask: nothing past it is
  computed), `is_causal` (cuDNN skips the tiles above the diagonal) and a boolean mask that
  keeps each token to its own row (and a sliding window); the result scattered back.
- The layer's output is the dense result on fresh tokens and the paged one elsewhere.

Why one packed sequence and a mask rather than cuDNN's ragged (THD) layout: jax 0.10.2's
public `dot_product_attention` has no segment offsets, and the private packed layout needs a
Hopper GPU and cuDNN to be present at trace time. The mask costs an [N, N] bias read per call
and the work of the cross-row tiles under the diagonal when a step holds several fresh prompts.

Within a fresh row the tokens must be in position order (the engine's are); the mask is built
from positions, so the order only decides which tiles `is_causal` may skip.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import reference
from pallas_kernels.reference import RaggedMetadata

# "cudnn" / "xla": jax.nn.dot_product_attention's; "tokamax": PyPI tokamax's flash attention,
# Mosaic GPU (Hopper and Blackwell) else its Triton kernel; "tokamax-xla": tokamax's XLA one
# (its CPU stand-in). tokamax is optional: imported only when asked for.
IMPLEMENTATIONS = ("cudnn", "xla", "tokamax", "tokamax-xla")
TOKAMAX_KERNELS = {"tokamax": ("mosaic", "triton"), "tokamax-xla": ("xla",)}
# cuDNN's fused attention takes 16-bit inputs and head dims that are multiples of 8, up to 256
# from Hopper on (128 before); elsewhere `supported` routes every row to the paged kernel.
CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
CUDNN_MAX_HEAD_DIM = 256


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PromptSplit:
    """A step's attention inputs split between the dense and the paged kernels (int32).

    `md` is the step's RaggedMetadata; `paged_seq_lens` [R] its seq_lens with the fresh rows'
    set to 0 (what the paged kernel gets beside the dense one); `order` [N] lists the fresh
    tokens first (in flat order), then the others; `fresh_count` [1] how many are fresh;
    `token_row` [N] each token's row (R for padding tokens)."""

    md: RaggedMetadata
    paged_seq_lens: jax.Array
    order: jax.Array
    fresh_count: jax.Array
    token_row: jax.Array

    @property
    def slot_mapping(self) -> jax.Array:
        """What the model's K/V write reads: the step's slots, unchanged."""
        return self.md.slot_mapping

    def paged(self) -> RaggedMetadata:
        """The metadata the paged kernel runs beside `dense`: fresh rows see no page."""
        return dataclasses.replace(self.md, seq_lens=self.paged_seq_lens)


def split(md: RaggedMetadata) -> PromptSplit:
    """The step's fresh rows taken out of the paged kernel's work (see the module docstring)."""
    qsl = md.query_start_loc
    qlen = jnp.diff(qsl)
    fresh_row = (qlen > 0) & (md.seq_lens == qlen)
    n = md.positions.shape[0]
    valid = reference.ragged_valid(qsl, n)
    token_row = jnp.where(valid, reference.token_rows(qsl, n), qsl.shape[0] - 1)  # R: padding
    fresh_tok = valid & fresh_row[jnp.minimum(token_row, qsl.shape[0] - 2)]
    order = jnp.argsort(~fresh_tok, stable=True).astype(jnp.int32)
    paged_lens = jnp.where(fresh_row, 0, md.seq_lens).astype(md.seq_lens.dtype)
    count = jnp.sum(fresh_tok, dtype=jnp.int32)[None]
    return PromptSplit(md, paged_lens, order, count, token_row.astype(jnp.int32))


def supported(q, implementation: str) -> bool:
    """Whether `implementation` takes q's dtype and head dim (a static, trace-time answer)."""
    if implementation != "cudnn":
        return True
    return jnp.dtype(q.dtype) in CUDNN_DTYPES and q.shape[-1] % 8 == 0 and q.shape[-1] <= CUDNN_MAX_HEAD_DIM


def dense(q, k, v, plan: PromptSplit, *, scale: float, implementation: str, window: int | None = None):
    """Fresh tokens' attention over their own rows' k/v: q [N, H, D], k/v [N, KVH, D] (the
    step's new keys as the pool holds them) -> [N, H, D], zeros on tokens that are not fresh."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    order = plan.order
    row = plan.token_row[order]
    pos = plan.md.positions[order]
    live = jnp.arange(order.shape[0]) < plan.fresh_count[0]
    keep = (row[:, None] == row[None, :]) & (pos[None, :] <= pos[:, None]) & live[:, None] & live[None, :]
    if window:
        keep &= pos[None, :] > pos[:, None] - window
    if implementation in TOKAMAX_KERNELS:
        fused, impl = _tokamax().dot_product_attention, TOKAMAX_KERNELS[implementation]
    else:
        fused, impl = jax.nn.dot_product_attention, implementation
    out = fused(
        q[order][None],
        k[order][None],
        v[order][None],
        mask=keep[None, None],
        scale=scale,
        is_causal=True,
        query_seq_lengths=plan.fresh_count,
        key_value_seq_lengths=plan.fresh_count,
        implementation=impl,
    )[0]
    out = jnp.where(live[:, None, None], out, jnp.zeros((), out.dtype))
    return jnp.zeros_like(out).at[order].set(out, unique_indices=True)


def _tokamax():
    """tokamax, imported. Its options are absl flags, and the first read of one parses sys.argv
    unless absl's flags are parsed already: under a server or pytest that command line is not
    tokamax's and the parse raises. Marking them parsed keeps every flag at its default."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    import tokamax

    return tokamax


def fresh_tokens(plan: PromptSplit) -> jax.Array:
    """[N] bool: the tokens whose rows `dense` computes."""
    n = plan.order.shape[0]
    return jnp.zeros((n,), bool).at[plan.order].set(jnp.arange(n) < plan.fresh_count[0], unique_indices=True)
