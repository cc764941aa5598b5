"""Several decode steps in one device call (`num_scheduler_steps`, vLLM's multi-step scheduling;
tpu-inference and JetStream loop decode steps on the device the same way).

A decode step's device work on an accelerator can be shorter than the host's work around it
(scheduling, building the batch, dispatching ~300 arrays, reading and applying the tokens,
detokenizing): the chip then waits for the host. When every row of a step is a plain decode row
(one token each, no grammar, penalties or logprobs: nothing the host must see between tokens),
the step runs `num_steps` iterations in one `lax.fori_loop`: each iteration's sampled token is
the next one's input, positions and sequence lengths move on by one, the KV slot of the new
token is read from the row's block table on the device, and the sampling counter (which, with
the seed, makes a row's random key) advances, so a row draws exactly the tokens single steps
would. The host pays its per-step cost once per call.

The host owns pages for the tokens it will keep (the scheduler's lookahead); a position past a
row's pages writes to the dummy page, and tokens past a row's stop (EOS, max_tokens, a stop
string) are dropped on the host, as the tokens of a step already in flight are.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from jaxserve.runner.step_batch import DUMMY_PAGE, StepBatch
from pallas_kernels.reference import RaggedMetadata, ragged_valid


def advance(batch: StepBatch, sampled: jax.Array, page_size: int) -> tuple[StepBatch, jax.Array]:
    """The decode-only batch one token later: row r's token is `sampled[r]` at the next position.
    In a decode-only batch token i is row i's (padding follows the live rows). Returns the batch
    and its token ids."""
    attn = batch.attn
    n, r = batch.num_tokens, batch.num_rows
    real = ragged_valid(attn.query_start_loc, n)
    live = jnp.diff(attn.query_start_loc) > 0
    tokens = jnp.where(real, jnp.zeros((n,), jnp.int32).at[:r].set(sampled[:n]), 0)
    positions = attn.positions + real.astype(jnp.int32)
    row = jnp.minimum(jnp.arange(n), r - 1)

    def slots_of(tables, old):
        width = tables.shape[1]
        index = positions // page_size
        page = jnp.where(index < width, tables[row, jnp.minimum(index, width - 1)], DUMMY_PAGE)
        return jnp.where(real, page * page_size + positions % page_size, old)

    slots = slots_of(attn.block_tables, attn.slot_mapping)
    meta = RaggedMetadata(slots, attn.block_tables, attn.seq_lens + live, attn.query_start_loc, positions)
    sampling = dataclasses.replace(batch.sampling, counters=batch.sampling.counters + live)
    feed = jnp.full_like(batch.feed, -1)
    local = {}
    if batch.local_tables is not None:  # the sliding layers' pool: its slots from its own tables
        local = {"local_slots": slots_of(batch.local_tables, batch.local_slots)}
    return dataclasses.replace(batch, tokens=tokens, attn=meta, sampling=sampling, feed=feed, **local), tokens


def run(step: Callable, kv, batch: StepBatch, tokens: jax.Array, num_steps: jax.Array, max_steps: int, page_size: int):
    """`step(kv, batch, tokens) -> (kv, (ids [R], chosen, top ids, top logprobs))` run `num_steps`
    (traced, 1..max_steps) times. Returns (kv, the last iteration's outputs with its ids replaced
    by every iteration's [max_steps, R] (rows past num_steps zero), the last iteration's ids).
    One forward pass in the program (the loop body), so it compiles as a single step does."""
    r = batch.num_rows
    out_shape = jax.eval_shape(lambda kv, b, t: step(kv, b, t)[1], kv, batch, tokens)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shape)

    def body(j, carry):
        kv, b, t, ids, _ = carry
        kv, out = step(kv, b, t)
        b, t = advance(b, out[0], page_size)
        return kv, b, t, ids.at[j].set(out[0]), out

    ids = jnp.zeros((max_steps, r), jnp.int32)
    kv, _, _, ids, out = jax.lax.fori_loop(0, num_steps, body, (kv, batch, tokens, ids, zeros))
    return kv, (ids, *out[1:]), out[0]
