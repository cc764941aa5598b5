"""The device side: one jitted ragged step, plus speculative verification and page copies.

Pure functions of arrays, jitted with the model graph and config static and the KV cache
donated. The runner never sees a request: it takes rows (`step_batch.Chunk`: token ids, a
start position, a block table, sampling controls), lays them out as one flat `StepBatch`
padded to a token bucket and runs ONE step over it: decode rows, prompt chunks and rows that
finish their prompt and sample their first token, all in one forward pass that reads every
weight once (vLLM v1's and tpu-inference's shape). Every dynamic size is padded to a bucket,
so warm-up compiles everything serving will ever run.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import logging
import os
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.models import eagle
from jaxserve.models.model_config import ModelConfig
from jaxserve.parallel.multihost import to_host
from jaxserve.runner import attention, decode_loop, host_memory, sampling, step_batch
from jaxserve.runner.attention import AttentionBackend
from jaxserve.runner.executable_cache import Deferred, ExecutableStore, Step, compile_ahead
from jaxserve.runner.host_times import HostTimes, phase
from jaxserve.runner.runner_config import RunnerConfig, pow2_buckets
from jaxserve.runner.sampling import sample
from jaxserve.runner.step_batch import DUMMY_PAGE, GREEDY, Chunk, StepBatch
from pallas_kernels import reference

log = logging.getLogger("jaxserve.runner")


def bucket_for(buckets: tuple[int, ...], n: int) -> int:
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


def default_argmax(mesh) -> Callable:
    """Greedy sampling's argmax: on the CPU without a mesh the native one-pass kernel (a custom
    call, which XLA cannot split across chips), where it is built; else sampling.argmax. Both
    give the first index of the row maximum."""
    if mesh is None and jax.default_backend() == "cpu":
        from pallas_kernels import native_argmax

        if native_argmax.available():
            return native_argmax.argmax
    return sampling.argmax


def _forward(
    graphdef,
    backend: AttentionBackend,
    params,
    kv,
    batch: StepBatch,
    tokens,
    token_index,
    with_hidden: bool = False,
    num_live_logits=None,
):
    """The model over the batch's flat tokens (one row of N), KV written into the pages inside;
    logits [M, V] at the flat `token_index` only, of which the first `num_live_logits` are real
    (and with_hidden, every token's final-norm hidden state [1, N, H] third)."""
    model = nnx.merge(graphdef, params)
    md = batch.layer_meta(backend.metadata)  # with a local pool, each layer group's own
    live = batch.attn.query_start_loc[-1]  # the real tokens; the bucket's padding follows them
    return model(
        tokens[None],
        batch.positions[None],
        kv,
        md,
        backend.forward,
        token_index=token_index,
        num_live_tokens=live,
        return_hidden=with_hidden,
        num_live_logits=num_live_logits,
    )


def _sample_rows(
    logits, batch: StepBatch, want_logprobs, *, num_logprobs: int, argmax_fn: Callable, greedy_only: bool = False
):
    """Each row's token from its logits [R, V] with every sampling control and the grammar
    bitmask, and (want_logprobs, a traced bool) the chosen token's logprob and the top
    `num_logprobs`. On the CPU which work runs is decided on the device (lax.cond): a greedy
    step skips the noise and the top-k/top-p filters, a step without controls their passes, a
    step without logprobs the log-softmax, so none is a separate executable. Elsewhere a cond's
    predicate goes through the host, so the host says it (greedy_only, static: every row greedy
    and none with a control or grammar): such a step is the argmax alone, no sort, noise or
    penalty pass. Returns (tokens [R], chosen [R], top ids [R, n], top logprobs [R, n])."""
    n = max(1, num_logprobs)
    r = logits.shape[0]

    def run(do_sample: bool, lp: bool):
        def f(x):
            out = sample(
                x,
                batch.sampling,
                batch.bitmask,
                do_sample=do_sample,
                num_logprobs=n if lp else 0,
                argmax_fn=argmax_fn,
                controls=not greedy_only,
            )
            if lp:
                return out
            return out[0], jnp.zeros((r,), jnp.float32), jnp.zeros((r, n), jnp.int32), jnp.zeros((r, n), jnp.float32)

        return f

    def with_lp(lp: bool):
        if greedy_only:
            return run(False, lp)
        if jax.default_backend() != "cpu":  # a GPU cond's predicate goes through the host
            return run(True, lp)
        do_sample = jnp.any(batch.active & (batch.sampling.temperature > 0))
        return lambda x: jax.lax.cond(do_sample, run(True, lp), run(False, lp), x)

    if num_logprobs == 0:
        return with_lp(False)(logits)
    return jax.lax.cond(want_logprobs, with_lp(True), with_lp(False), logits)


def _ragged_step(
    graphdef,
    backend: AttentionBackend,
    params,
    kv,
    batch: StepBatch,
    prev_tokens,
    want_logprobs,
    targets=None,
    num_steps=None,
    *,
    num_logprobs: int,
    num_top: int = 1,
    with_hidden: bool = False,
    argmax_fn: Callable = sampling.argmax,
    max_steps: int = 1,
    page_size: int = 0,
    greedy_only: bool = False,
):
    """The step serving runs: every row of the batch (decodes, prompt chunks, a prompt's last
    chunk with its first sampled token) in one forward pass, each sampling row sampled at its
    last token in the same call, so only the sampled ids and logprobs leave the device. A token
    with batch.feed >= 0 is the previous step's sampled id of that row (`prev_tokens`, one
    fixed-size buffer), so the host can dispatch this step before it has read them. Returns
    (kv, (tokens, chosen logprob, top ids, top logprobs), this step's ids padded to
    prev_tokens' size).

    With `targets` [N] (each token's next prompt token: prompt logprobs, lm-eval's
    loglikelihood) it also scores every token: the log-softmax of its logits gathered at its
    target, the target's rank in the vocabulary (1: the most likely) and the top `num_top`,
    returned fourth as (logprob [N], rank [N], top ids [N, n], top lps [N, n]). That form has
    executables of its own, so the plain step keeps the vocabulary projection to sampled rows.

    with_hidden (an EAGLE draft head rides along): the last output is (every token's final-norm
    hidden state [N, H], the tokens as run [N]), the features the head is filled from.

    max_steps > 1 (`num_scheduler_steps`): the plain step runs `num_steps` (traced) decode
    iterations in one call (runner/decode_loop.py); the ids come back as [max_steps, R].

    greedy_only (off the CPU): the host's word that no row samples or has a control
    (`_sample_rows`)."""
    tokens = jnp.where(batch.feed >= 0, prev_tokens[jnp.maximum(batch.feed, 0)], batch.tokens)
    if max_steps > 1 and targets is None and not with_hidden:

        def one(kv, b, t):
            logits, kv = _forward(graphdef, backend, params, kv, b, t, b.logits_indices, False, b.live_rows())
            return kv, _sample_rows(
                logits, b, want_logprobs, num_logprobs=num_logprobs, argmax_fn=argmax_fn, greedy_only=greedy_only
            )

        kv, out, last = decode_loop.run(one, kv, batch, tokens, num_steps, max_steps, page_size)
        return (kv, out, jnp.zeros_like(prev_tokens).at[: batch.num_rows].set(last))
    if targets is None:
        at, live = batch.logits_indices, batch.live_rows()
    else:
        at, live = jnp.arange(batch.num_tokens), batch.attn.query_start_loc[-1]
    logits, kv, *hidden = _forward(graphdef, backend, params, kv, batch, tokens, at, with_hidden, live)
    extra = ((hidden[0][0], tokens),) if with_hidden else ()
    rows = logits if targets is None else logits[batch.logits_indices]
    out = _sample_rows(
        rows, batch, want_logprobs, num_logprobs=num_logprobs, argmax_fn=argmax_fn, greedy_only=greedy_only
    )
    fed = jnp.zeros_like(prev_tokens).at[: batch.num_rows].set(out[0])
    if targets is None:
        return (kv, out, fed, *extra)
    return (kv, out, fed, _score_tokens(logits, targets, num_top), *extra)


def _score_tokens(logits, targets, num_top: int):
    """Every token's score against its target [N]: the log-softmax of its logits [N, V] at the
    target, the target's rank (1: the most likely) and the top `num_top` (ids, logprobs)."""
    logp = jax.nn.log_softmax(logits, axis=-1)  # float32, as the sampled rows' logprobs
    chosen = jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]
    rank = 1 + jnp.sum(logp > chosen[:, None], axis=-1, dtype=jnp.int32)
    top_lp, top_ids = jax.lax.top_k(logp, num_top)
    return chosen, rank, top_ids.astype(jnp.int32), top_lp


def _copy_pages(kv, src, dst, *, layers: int = 1):
    """Copy pages src -> dst in every array of every layer's cache tuple (scales too); in a
    stacked pool (`layers` layers a tuple, layer l's page p at l * P + p) in every layer."""

    def copy(x):
        by_layer = x.reshape(layers, x.shape[0] // layers, *x.shape[1:])
        return by_layer.at[:, dst].set(by_layer[:, src]).reshape(x.shape)

    return tuple(tuple(copy(x) for x in group) for group in kv)


def _copy_grouped_pages(kv, src, dst, local_src, local_dst, *, local_layers: tuple[int, ...]):
    """`_copy_pages` with a local pool: the layers in local_layers copy local_src -> local_dst."""
    return tuple(
        tuple(x.at[local_dst if i in local_layers else dst].set(x[local_src if i in local_layers else src]) for x in c)
        for i, c in enumerate(kv)
    )


@dataclasses.dataclass
class PromptLogprobs:
    """One row's scores: its token j's next token (the row's target j) has `logprobs[j]` and
    vocabulary rank `ranks[j]`; top_ids/top_logprobs [m, n] the n most likely."""

    logprobs: np.ndarray  # [m]
    ranks: np.ndarray  # [m]
    top_ids: np.ndarray  # [m, n]
    top_logprobs: np.ndarray  # [m, n]


@dataclasses.dataclass
class StepResult:
    """Row i of a step: its sampled token (rows that sample), logprobs when asked, and
    prompt[i] its scores when it was scored (else None)."""

    tokens: np.ndarray  # [rows]
    logprobs: np.ndarray | None  # [rows]
    top_ids: np.ndarray | None  # [rows, n]
    top_logprobs: np.ndarray | None
    prompt: list[PromptLogprobs | None] = dataclasses.field(default_factory=list)
    # A call of several decode steps (num_scheduler_steps): row i's ids in order, steps[:, i];
    # `tokens` is then steps[0]. None for a single step.
    steps: np.ndarray | None = None  # [num_steps, rows]


@dataclasses.dataclass
class PendingStep:
    """A dispatched step whose results are still on the device (JAX dispatches
    asynchronously): `result()` waits for them and copies them to the host."""

    outputs: tuple  # device arrays, rows in the caller's order
    num_rows: int
    want_logprobs: bool
    scores: tuple | None = None  # the scoring step's per-token arrays
    scored: tuple = ()  # (row, first flat token, length) of each scored row
    num_steps: int = 0  # > 0: the decode loop's program ran that many steps; its ids are [max_steps, R]

    def result(self) -> StepResult:
        n = self.num_rows
        steps = None
        if self.num_steps:
            steps = to_host(self.outputs[0])[: self.num_steps, :n]
            if self.num_steps > 1:  # decode rows without logprobs (step_async checks)
                return StepResult(steps[0], None, None, None, [None] * n, steps)
        # Each copy off the device costs tens of microseconds of host time, so the logprob
        # outputs are read only when a row asked for them.
        outs = self.outputs if self.want_logprobs else self.outputs[:1]
        host = [steps[0] if steps is not None and i == 0 else to_host(x)[:n] for i, x in enumerate(outs)]
        prompt: list[PromptLogprobs | None] = [None] * n
        if self.scores is not None:
            lp, rank, top_ids, top_lp = (to_host(x) for x in self.scores)
            for row, start, m in self.scored:
                sl = slice(start, start + m)
                prompt[row] = PromptLogprobs(lp[sl], rank[sl], top_ids[sl], top_lp[sl])
        if not self.want_logprobs:
            return StepResult(host[0], None, None, None, prompt)
        return StepResult(*host, prompt)


def logit_places(
    qsl: np.ndarray, rows: Sequence[Chunk], num_rows: int, k: int, num_tokens: int
) -> tuple[np.ndarray, int, np.ndarray]:
    """Where a prompt-lookup verify step takes logits (speculative.verify_ragged): the flat
    index of each row's last token and its drafts, row after row, then padding; how many are
    real; and gather [num_rows, k + 1], each (row, j)'s place among them (its last real place
    past its drafts). A row without drafts (or without sampling) takes one place. Every place
    is a distinct token of the step, so there are at most num_tokens: the vocabulary's
    projection, the argmax and the sampler run over that many places, not num_rows x (k + 1)
    (at batch 1 a step of 8 tokens had 8 x 16 places at k = 15, each a row of the vocabulary)."""
    index = np.zeros((min(num_rows * (k + 1), num_tokens),), np.int32)
    gather = np.zeros((num_rows, k + 1), np.int32)
    m = 0
    for i, c in enumerate(rows):
        if c.sampling is None:  # a prompt chunk: no logits (its gather row is never read)
            continue
        last = int(qsl[i]) + len(c.tokens) - 1 - c.num_drafts
        n = c.num_drafts
        index[m : m + n + 1] = last + np.arange(n + 1)
        gather[i] = m + np.minimum(np.arange(k + 1), n)
        m += n + 1
    return index, m, gather


def replicated(method: Callable) -> Callable:
    """A runner call every process must make: with several processes, the leader first
    hands its host inputs to the others (multihost.StepBroadcaster)."""

    @functools.wraps(method)
    def wrapper(self, *args):
        if self.broadcaster is not None and self.broadcaster.leader:
            self.broadcaster.send(method.__name__, args)
        return method(self, *args)

    return wrapper


def on_flat_params(fn: Callable, treedef) -> Callable:
    """fn(params, ...) as a function of the parameters' flat tuple of arrays (`_Weights.params`),
    rebuilt into their nnx State inside the trace: a call then flattens a tuple, not a State."""

    def flat(leaves, *args, **kw):
        return fn(jax.tree.unflatten(treedef, leaves), *args, **kw)

    return flat


def pin_kv(fn: Callable, sharding, kv_out: int | None, rest=None) -> Callable:
    """Wrap a step so the KV cache it returns keeps `sharding` (tensor parallelism): the next
    call then sees the same input sharding, so donation holds and nothing recompiles. `rest`:
    a sharding for the step's other outputs (replicated sampled ids)."""
    if sharding is None:
        return fn

    def wrapped(*args, **kw):
        out = fn(*args, **kw)
        if kv_out is None:
            return jax.lax.with_sharding_constraint(out, sharding)
        out = list(out)
        for i in range(len(out)):
            if i == kv_out:
                out[i] = jax.lax.with_sharding_constraint(out[i], sharding)
            elif rest is not None:
                out[i] = jax.lax.with_sharding_constraint(out[i], rest)
        return tuple(out)

    return wrapped


class _Weights:
    """One model on the device: its parameters, its KV page pool and its jitted steps.
    The target and a speculative draft each have one; both use the same page ids.
    `state` is the parameters' nnx State (to inspect them); `params` the same arrays as the flat
    tuple every step is called with."""

    def __init__(
        self,
        name: str,
        module: nnx.Module,
        cfg: ModelConfig,
        rc: RunnerConfig,
        mesh=None,
        store: ExecutableStore | None = None,
    ):
        self.cfg = cfg
        kv_cache_dtype = rc.kv_cache_dtype
        _prepare(module, mesh, rc.matmul_impl, rc.matmul_dtype)
        self.graphdef, self.state = nnx.split(module)
        self.kv_sharding = None
        if mesh is not None:
            from jaxserve.parallel import sharding as shd

            self.state = shd.shard_params(self.state, cfg, mesh)
            self.kv_sharding = shd.kv_sharding(cfg, mesh, quantized=kv_cache_dtype in reference.SCALED_KV_DTYPES)
        # Every step takes the parameters as the flat tuple of their arrays (`on_flat_params`):
        # jax flattens an nnx State through Python callbacks on every call, a tuple in C++.
        # On SmolLM2 (183 arrays) that was 0.7-0.9 ms of the host's time per step.
        leaves, self.params_tree = jax.tree.flatten(self.state)
        self.params = tuple(leaves)
        self.eagle = isinstance(module, eagle.EagleHead)
        if self.eagle and mesh is not None:
            raise ValueError("speculative_model: an EAGLE head is not supported with tensor_parallel_size > 1")
        # the sliding layers' own pool (rc.local_num_pages > 0): their layers' buffers hold that many pages
        self.local_layers = cfg.kv_groups().get("local", ()) if rc.local_num_pages and not self.eagle else ()
        # Off a mesh every layer's pages share one tuple of arrays (reference.PoolLayer: a call
        # then takes and returns 2 pool arrays, not 2 a layer); under one, a tuple a layer (the
        # sharded attention takes a layer's pages), and so with a local pool (its layers' pages
        # are fewer).
        self.kv_layers = cfg.num_layers if mesh is None and not self.eagle and not self.local_layers else 1
        pool = functools.partial(
            _empty_pool,
            cfg,
            self.eagle,
            rc.num_pages,
            rc.page_size,
            jnp.dtype(rc.dtype),
            kv_cache_dtype,
            rc.local_num_pages if self.local_layers else 0,
            self.kv_layers,
        )
        self.kv = jax.jit(pool, out_shardings=self.kv_sharding)()
        self.huge_pages = host_memory.advise_huge_pages_in_background((self.params, self.kv))  # CPU buffers only
        self.backend = attention.make(rc.attention_impl, rc.interpret)
        self.argmax = default_argmax(mesh)
        if mesh is not None and rc.attention_impl in attention.CUSTOM_CALL_IMPLS:  # XLA cannot split them
            from jaxserve.parallel import sharding as shd

            self.backend = self.backend.wrap(lambda fn: shd.shard_attention(fn, cfg, mesh))
        self._jit_steps(name, store, _replicated(mesh) if mesh is not None else None)

    def _jit_steps(self, name: str, store: ExecutableStore | None, replicate) -> None:
        """The model's jitted steps, its KV cache donated and kept on its sharding (`replicate`:
        the sharding of the other outputs under a mesh): the one step serving runs, the same
        program as the scoring step (prompt logprobs; kept apart so the executables of each are
        counted and stored by name), and the page copy."""

        def jitted(fn, static=()):
            return jax.jit(
                pin_kv(on_flat_params(fn, self.params_tree), self.kv_sharding, 0, replicate),
                donate_argnums=(1,),
                static_argnames=static,
            )

        ragged = jitted(
            functools.partial(_ragged_step, self.graphdef, self.backend, argmax_fn=self.argmax),
            ("num_logprobs", "num_top", "with_hidden", "max_steps", "page_size", "greedy_only"),
        )
        self.step = Step(f"{name}-step", ragged, store, fixed=2)
        self.score = Step(f"{name}-score", ragged, store, fixed=2)
        copy = functools.partial(_copy_pages, layers=self.kv_layers)
        if self.local_layers:
            copy = functools.partial(_copy_grouped_pages, local_layers=tuple(self.local_layers))
        self.copy = Step(
            f"{name}-copy", jax.jit(pin_kv(copy, self.kv_sharding, None), donate_argnums=(0,)), store, fixed=1
        )


def _prepare(module: nnx.Module, mesh, matmul_impl: str, matmul_dtype: str) -> None:
    """Ready a module for its runner, in place: its weights packed for the native matmul, and
    under a mesh, its layers that shard_map themselves (expert parallelism) bound to it."""
    if matmul_impl == "native":  # resolve() never picks it under tensor parallelism
        from jaxserve.models.linear import pack_native

        module.untie_lm_head()  # the model contract (models/contract.py); a no-op where nothing is tied
        pack_native(module, matmul_dtype)
    if mesh is not None:
        from jaxserve.parallel import sharding as shd

        shd.bind_mesh(module, mesh)


def _empty_pool(
    cfg: ModelConfig,
    is_eagle: bool,
    num_pages: int,
    page_size: int,
    dtype,
    kv_cache_dtype: str,
    local_num_pages: int = 0,
    stacked: int = 1,
):
    """A model's KV page pool, zeroed: a cache tuple per layer, or (stacked > 1) one tuple of
    every layer's pages (reference.stacked_pool); an EAGLE head's is its one layer's KV, then
    the target's features in pages of the same ids. local_num_pages > 0: the sliding-window
    layers' tuples hold that many pages (the local pool's ids; never stacked)."""

    def layer(pages: int = num_pages):
        return reference.empty_kv_cache(pages, page_size, cfg.num_kv_heads, cfg.head_dim, dtype, kv_cache_dtype)

    if is_eagle:
        return (layer(), (eagle.empty_features(num_pages, page_size, cfg.hidden_size, dtype),))
    if stacked > 1:
        return reference.stacked_pool(layer, stacked)
    return tuple(
        layer(local_num_pages if local_num_pages and cfg.is_sliding(i) else num_pages) for i in range(cfg.num_layers)
    )


def _mesh(cfg: RunnerConfig, model_cfg: ModelConfig, draft_cfg: ModelConfig | None):
    """The device mesh of a model split across chips (tensor or expert parallelism), or None;
    ValueError where the model's shapes do not divide."""
    if cfg.tensor_parallel_size <= 1 and cfg.expert_parallel_size <= 1:
        return None
    from jaxserve.parallel import sharding as shd

    for c in (model_cfg, draft_cfg):
        if c is not None:
            shd.check_divisible(c, cfg.tensor_parallel_size)
    shd.check_expert_parallel(model_cfg, cfg.expert_parallel_size)
    return shd.make_mesh(cfg.tensor_parallel_size, ep=cfg.expert_parallel_size)


def _executable_store(cfg: RunnerConfig, mesh) -> ExecutableStore | None:
    """The store that keeps compiled steps across restarts (compilation_cache_dir), or None
    (not asked for, or its directory cannot be used: a warning, not an error)."""
    if not cfg.compilation_cache_dir:
        return None
    try:
        devices = list(mesh.devices.flat) if mesh is not None else None  # None: the default device
        return ExecutableStore(cfg.compilation_cache_dir, cfg.store_context or repr(cfg), devices)
    except OSError as e:
        log.warning("compiled steps are not kept across restarts: %s", e)
        return None


def _batch_buckets(cfg: RunnerConfig) -> tuple[int, ...]:
    """A speculative step's row buckets. It runs over the live sequences only, padded to a
    power-of-two batch of k + 1 tokens each: the slot a request holds is host bookkeeping, the
    device addresses KV through pages."""
    buckets = pow2_buckets(min(8, cfg.max_slots), cfg.max_slots)
    if cfg.single_row_bucket and buckets[0] > 1:
        buckets = (1, *buckets)
    return buckets


def _replicated(mesh):
    from jax.sharding import NamedSharding, PartitionSpec

    return NamedSharding(mesh, PartitionSpec())


def _speculative_step(name: str, fn: Callable, w: _Weights, store, static=("do_sample",), **kw) -> Step:
    """fn(graphdef, backend, params, kv, batch, ..., do_sample, argmax_fn) of model w, jitted
    with its KV cache donated (and kept on its sharding), do_sample static."""
    jitted = on_flat_params(functools.partial(fn, w.graphdef, w.backend, argmax_fn=w.argmax, **kw), w.params_tree)
    return Step(
        name,
        jax.jit(pin_kv(jitted, w.kv_sharding, 0), donate_argnums=(1,), static_argnames=static),
        store,
        fixed=2,
    )


def _speculative_steps(target: _Weights, draft: _Weights | None, store, page_size: int) -> tuple:
    """A speculative engine's jitted steps (runner/speculative.py): (the target's verify step of
    k + 1 tokens a row, its prompt-lookup twin inside the ragged step, a draft's propose step,
    an EAGLE head's fill (features and KV over a target step), its write of the target's
    features at the verified positions), None where the engine has no such step."""
    from jaxserve.runner import speculative

    verify = _speculative_step("verify", speculative.verify, target, store, ("do_sample", "with_hidden"))
    # prompt lookup: verification rides in the ragged step with the prompt chunks
    verify_ragged = _speculative_step("verify-ragged", speculative.verify_ragged, target, store)
    propose = fill = write = None
    if draft is not None and draft.eagle:
        d = draft
        propose = _speculative_step("propose", speculative.eagle_propose, d, store, page_size=page_size)
        fill = on_flat_params(
            functools.partial(speculative.eagle_fill, d.graphdef, d.backend, page_size=page_size), d.params_tree
        )
        fill = Step("draft-fill", jax.jit(fill, donate_argnums=(1,)), store, fixed=2)
        write = Step("draft-write", jax.jit(speculative.eagle_write, donate_argnums=(0,)), store, fixed=1)
    elif draft is not None:
        propose = _speculative_step("propose", speculative.draft_propose, draft, store)
    return verify, verify_ragged, propose, fill, write


class ModelRunner:
    """The target model (and a speculative draft) on the device, with every jitted step."""

    def __init__(
        self,
        model: nnx.Module,
        model_cfg: ModelConfig,
        cfg: RunnerConfig,
        draft: nnx.Module | None = None,
        draft_cfg: ModelConfig | None = None,
    ):
        self.model_cfg = model_cfg
        self.cfg = cfg
        self.dtype = jnp.dtype(cfg.dtype)
        self.attention_impl = cfg.attention_impl
        self.max_model_len = cfg.max_model_len
        ps = cfg.page_size
        self.max_pages_per_seq = -(-self.max_model_len // ps)
        # Block tables have one fixed width: the attention loop's trip count follows the
        # longest live context, so no per-length buckets (and compiles) are needed.
        self.table_width = -(-self.max_pages_per_seq // 2) * 2
        self.token_buckets = cfg.token_buckets
        self.num_pages = cfg.num_pages
        self.local = cfg.local_num_pages > 0  # the sliding layers have a pool (and block tables) of their own
        self.mesh = _mesh(cfg, model_cfg, draft_cfg)
        from jaxserve.parallel import multihost

        self.broadcaster = multihost.StepBroadcaster() if multihost.is_multiprocess() else None
        # compiled steps kept across restarts; with several processes JAX's cache does it
        self.store = _executable_store(cfg, self.mesh) if self.broadcaster is None else None
        self.target = _Weights("target", model, model_cfg, cfg, self.mesh, self.store)
        self.draft = _Weights("draft", draft, draft_cfg, cfg, self.mesh, self.store) if draft is not None else None
        self.models = [w for w in (self.target, self.draft) if w is not None]
        self.copy_batch = max(8, cfg.max_slots)
        self.batch_buckets = _batch_buckets(cfg)
        # The previous step's sampled ids, on the device (row i at index i): the next step reads
        # its fed tokens from here (step_async's feed).
        self._prev_tokens = jnp.zeros((max(cfg.max_slots, self.rows_for(self.token_buckets[-1])),), jnp.int32)
        if self.mesh is not None:  # replicated
            self._prev_tokens = jax.device_put(self._prev_tokens, _replicated(self.mesh))
        self._bucket_defaults: dict[int, step_batch.Defaults] = {}
        self.spec_k = cfg.num_speculative_tokens
        # Decode steps one plain call may run (decode_loop.py); a speculative engine makes several
        # tokens a step its own way.
        self.max_steps = cfg.num_scheduler_steps if not self.spec_k and draft is None else 1
        self.host_times: HostTimes | None = None  # the step's host CPU time by phase, when measured
        # Off the CPU, where a lax.cond's predicate goes through the host, the plain step comes
        # in two executables a bucket: the argmax alone (every row greedy, no controls) and the
        # full sampler (`_sample_rows`). On the CPU one executable decides on the device.
        self.greedy_static = jax.default_backend() != "cpu"
        if self.spec_k:
            steps = _speculative_steps(self.target, self.draft, self.store, ps)
            self._verify, self._verify_ragged, self._propose, self._eagle_fill, self._eagle_write = steps

    @property
    def eagle(self) -> bool:
        """The draft is an EAGLE head (models/eagle.py), fed the target's features."""
        return self.draft is not None and self.draft.eagle

    @property
    def kv(self):
        return self.target.kv

    @property
    def is_follower(self) -> bool:
        """A process other than 0 of several: it only replays process 0's runner calls."""
        return self.broadcaster is not None and not self.broadcaster.leader

    def follow_leader(self) -> None:
        """On a follower process: replay the leader's calls (its warm-up included) until it stops."""
        self.broadcaster.follow(self)

    def release_followers(self) -> None:
        """On the leader: let the followers return from follow_leader."""
        if self.broadcaster is not None and self.broadcaster.leader:
            self.broadcaster.send("stop", ())

    def rows_for(self, num_tokens: int) -> int:
        """The row bucket of a token bucket: every running sequence has at most one row."""
        return min(num_tokens, self.cfg.max_slots)

    def batch(self, rows: Sequence[Chunk], num_rows: int, num_tokens: int, **kw) -> StepBatch:
        if "row_len" not in kw:  # the ragged step's row buckets keep their no-op inputs on the device
            kw["defaults"] = self._defaults(num_rows)
        return step_batch.build(
            rows,
            num_rows=num_rows,
            num_tokens=num_tokens,
            table_width=self.table_width,
            page_size=self.cfg.page_size,
            vocab_size=self.model_cfg.vocab_size,
            local=self.local,
            **kw,
        )

    def _defaults(self, num_rows: int) -> step_batch.Defaults:
        d = self._bucket_defaults.get(num_rows)
        if d is None:
            sharding = self._prev_tokens.sharding  # replicated over a mesh, or the one device
            put = functools.partial(jax.device_put, device=sharding)
            d = step_batch.Defaults.make(num_rows, self.model_cfg.vocab_size, put, self.table_width)
            self._bucket_defaults[num_rows] = d
        return d

    # -- steps -------------------------------------------------------------------------
    @replicated
    def step_async(
        self,
        rows: list[Chunk],
        want_logprobs: bool = False,
        feed: Sequence[int] = (),
        targets: Sequence[Sequence[int] | None] = (),
        num_steps: int = 1,
    ) -> PendingStep:
        """Dispatch one ragged step over `rows` (decodes, prompt chunks, a prompt's last chunk
        with its first token; a row samples at its last token when its `sampling` is set) and
        return without waiting for the device. Row i of the result is rows[i].

        feed[i] >= 0: row i's first token is the one the previous step sampled for its row
        feed[i] (rows[i].tokens[0] is ignored), read on the device, so this step can be
        dispatched before the host knows that token. targets[i] (optional): the token after
        each of row i's tokens: the step then runs as the scoring step and result.prompt[i] is
        the row's PromptLogprobs. num_steps > 1 (at most cfg.num_scheduler_steps): rows of one
        token each, no logprobs, decoded that many times in this call (runner/decode_loop.py);
        result().steps has each row's ids."""
        if num_steps > 1 and (
            num_steps > self.max_steps or want_logprobs or any(len(c.tokens) != 1 for c in rows) or any(targets)
        ):
            raise ValueError(f"num_steps={num_steps}: only decode rows without logprobs, at most {self.max_steps}")
        n_tok = sum(len(c.tokens) for c in rows)
        t = bucket_for(self.token_buckets, max(1, n_tok))
        with phase(self.host_times, "build"):
            batch = self.batch(rows, self.rows_for(t), t, feed=feed)
        want = np.bool_(want_logprobs and self.cfg.max_logprobs > 0)
        nlp = self.cfg.max_logprobs
        if not self.eagle:
            for d in self.models[1:]:  # a speculative draft fills its KV over the same rows (fed
                # tokens are the target's: its last step's ids)
                d.kv, _, _ = d.step(d.params, d.kv, batch, self._prev_tokens, np.bool_(False), num_logprobs=0)
        w = self.target
        eg = {"with_hidden": True} if self.eagle else {}
        scored = []
        if any(x is not None for x in targets):
            padded = np.zeros((t,), np.int32)
            qsl = batch.attn.query_start_loc
            for i, x in enumerate(targets):
                if x is not None:
                    if len(x) != len(rows[i].tokens):
                        raise ValueError(f"targets: {len(x)} for a row of {len(rows[i].tokens)} tokens")
                    padded[qsl[i] : qsl[i] + len(x)] = x
                    scored.append((i, int(qsl[i]), len(x)))
            w.kv, out, self._prev_tokens, scores, *hidden = w.score(
                w.params, w.kv, batch, self._prev_tokens, want, padded, num_logprobs=nlp, num_top=max(1, nlp), **eg
            )
            self._fill_eagle(batch, hidden)
            return PendingStep(out, len(rows), bool(want), scores, tuple(scored))
        loop = self.max_steps > 1  # the plain step's program is the decode loop (one trip by default)
        extra = (None, np.int32(num_steps)) if loop else ()
        if loop:
            eg = {"max_steps": self.max_steps, "page_size": self.cfg.page_size}
        if self.greedy_static:  # off the CPU: an all-greedy step without controls is the argmax alone
            eg["greedy_only"] = all(c.controls is None and (c.sampling is None or c.sampling[0] == 0) for c in rows)
        with phase(self.host_times, "dispatch"):
            w.kv, out, self._prev_tokens, *hidden = w.step(
                w.params, w.kv, batch, self._prev_tokens, want, *extra, num_logprobs=nlp, **eg
            )
        self._fill_eagle(batch, hidden)
        return PendingStep(out, len(rows), bool(want), num_steps=num_steps if loop else 0)

    def _fill_eagle(self, batch: StepBatch, hidden: list) -> None:
        """An EAGLE head's features and KV over a target step's tokens (hidden: the step's last
        output, (features [N, H], tokens [N]), when it has one)."""
        if hidden:
            d = self.draft
            d.kv = self._eagle_fill(d.params, d.kv, batch, *hidden[0])

    def step(self, rows: list[Chunk], want_logprobs: bool = False, targets=()) -> StepResult:
        """`step_async` and wait for its result."""
        return self.step_async(rows, want_logprobs, (), targets).result()

    def decode(self, rows: list[Chunk], num_logprobs: int = 0) -> StepResult:
        """One step over one token per row (tools, benchmarks): `step` by another name."""
        return self.step(rows, num_logprobs > 0)

    def prefill(self, chunks: list[Chunk], targets: Sequence[Sequence[int] | None] = ()) -> list[PromptLogprobs | None]:
        """Fill KV for chunks of sequences, sampling nothing, in steps of at most the largest
        token bucket; with targets, each scored chunk's PromptLogprobs."""
        chunks = [dataclasses.replace(c, sampling=None, controls=None) for c in chunks]
        targets = list(targets) + [None] * (len(chunks) - len(targets))
        out: list[PromptLogprobs | None] = []
        cap, group = self.token_buckets[-1], []

        def flush():
            if group:
                out.extend(self.step([c for c, _ in group], False, [x for _, x in group]).prompt)
                group.clear()

        for c, x in zip(chunks, targets):
            if sum(len(g.tokens) for g, _ in group) + len(c.tokens) > cap or len(group) == self.rows_for(cap):
                flush()
            group.append((c, x))
        flush()
        return out

    @replicated
    def speculate(self, rows: list[Chunk]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One speculative step: each row's tokens are [last] (the draft model proposes on the
        device) or [last, host proposals...]; the target verifies all k+1 positions in one
        pass. Returns (tokens [R, k+1], n_out [R], num_drafts [R]) in the order of `rows`:
        row i emits tokens[i, :n_out[i]]."""
        k = self.spec_k
        rows = [
            dataclasses.replace(
                c,
                tokens=list(c.tokens[: k + 1]) + [0] * (k + 1 - len(c.tokens[: k + 1])),
                num_drafts=min(len(c.tokens) - 1, k) if self.draft is None else k,
            )
            for c in rows
        ]
        r = bucket_for(self.batch_buckets, len(rows))
        batch = self.batch(rows, r, r * (k + 1), row_len=k + 1)
        do_sample = bool(np.any(batch.active & (batch.sampling.temperature > 0)))
        drafts, q = None, None
        if self.draft is not None:
            d = self.draft
            d.kv, drafts, q = self._propose(d.params, d.kv, batch, do_sample=do_sample)
        t = self.target
        if self.eagle:  # the target's features at the verified positions feed the head's next proposal
            t.kv, out, n_out, hidden = self._verify(
                t.params, t.kv, batch, drafts, q, do_sample=do_sample, with_hidden=True
            )
            d.kv = self._eagle_write(d.kv, hidden, batch.attn.slot_mapping)
        else:
            t.kv, out, n_out = self._verify(t.params, t.kv, batch, drafts, q, do_sample=do_sample)
        num_drafts = np.asarray([c.num_drafts for c in rows], np.int32)
        return to_host(out)[: len(rows)], to_host(n_out)[: len(rows)], num_drafts

    @replicated
    def speculate_ragged(self, rows: list[Chunk]) -> tuple[np.ndarray, np.ndarray]:
        """Prompt-lookup verification inside one ragged step: rows that sample are
        [prompt chunk..., last, d1..d_n] (n = num_drafts <= k host proposals, no chunk for a
        decode row); rows without sampling are prompt chunks. Returns (tokens [R, k+1], n_out
        [R]) in the order of `rows`: sampling row i emits tokens[i, :n_out[i]]."""
        k = self.spec_k
        t = bucket_for(self.token_buckets, sum(len(c.tokens) for c in rows))
        r = self.rows_for(t)
        batch = self.batch(rows, r, t)
        index, num_logits, gather = logit_places(batch.attn.query_start_loc, rows, r, k, t)
        do_sample = bool(np.any(batch.active & (batch.sampling.temperature > 0)))
        w = self.target
        w.kv, out, n_out = self._verify_ragged(
            w.params, w.kv, batch, index, np.int32(num_logits), gather, do_sample=do_sample
        )
        return to_host(out)[: len(rows)], to_host(n_out)[: len(rows)]

    @replicated
    def copy_pages(self, pairs: list[tuple]) -> None:
        """Copy-on-write: (src, dst) pairs of the full pool, (src, dst, "local") of the local one."""
        full = [p[:2] for p in pairs if len(p) == 2]
        local = [p[:2] for p in pairs if len(p) == 3]
        n = self.copy_batch
        for i in range(0, max(len(full), len(local)), n):
            arrays = [_index_pairs(full[i : i + n], n)]
            if self.local:
                arrays.append(_index_pairs(local[i : i + n], n))
            for w in self.models:
                w.kv = w.copy(w.kv, *(a for pair in arrays for a in pair))

    # -- warm-up -----------------------------------------------------------------------
    def warmup(self, progress: Callable[[str], None] | None = None, workers: int | None = None) -> float:
        """Compile every shape serving can produce; all writes go to the dummy page.

        The compiles run side by side on `workers` threads (default: $JAXSERVE_COMPILE_THREADS,
        else one per CPU, at most 8): a first pass lowers each job's program and starts its
        compile (executable_cache.compile_ahead), later passes run the jobs, each waiting for
        its executables. A job whose step calls another step (a draft's, EAGLE's fill) defers
        once per level. With several processes the followers replay the leader's calls in
        order: one at a time."""
        t0 = time.perf_counter()
        jobs = [("step", t) for t in self.token_buckets]
        if self.greedy_static:  # the full sampler's executables too (greedy rows warm the argmax's)
            jobs += [("step-sampled", t) for t in self.token_buckets]
        if self.cfg.prompt_logprobs:
            jobs += [("score", t) for t in self.token_buckets]
        if self.spec_k:
            jobs += [("speculate", b, do_sample) for b in self.batch_buckets for do_sample in (False, True)]
            if self.draft is None:
                jobs += [("speculate_ragged", t, do_sample) for t in self.token_buckets for do_sample in (False, True)]
        jobs.append(("copy", 1))
        if workers is None:
            workers = _compile_threads()
        if self.broadcaster is not None:
            workers = 1
        todo, first = list(enumerate(jobs)), True
        with compile_ahead(workers):
            while todo:
                deferred = []
                for i, job in todo:
                    if progress and first:
                        progress(f"compiling {job[0]} {job[1]} ({i + 1}/{len(jobs)})")
                    try:
                        self._warm(*job)
                    except Deferred:
                        deferred.append((i, job))
                if progress and deferred:
                    progress(f"waiting for {len(deferred)} compiles on {workers} threads")
                todo, first = deferred, False
        jax.block_until_ready([w.kv for w in self.models])
        self.wait_for_huge_pages()
        return time.perf_counter() - t0

    def _warm(self, kind: str, a: int, *rest) -> None:
        """One warm-up job: the call serving makes for this shape, on the dummy page."""
        pages = [DUMMY_PAGE] * self.max_pages_per_seq
        if kind == "copy":
            self.copy_pages([(DUMMY_PAGE, DUMMY_PAGE)])
        elif kind == "speculate_ragged":  # a tokens pick bucket a: one row with drafts where they fit
            drafts = min(self.spec_k, a - 1)
            self.speculate_ragged([Chunk([0] * a, 0, pages, (1.0 if rest[0] else 0.0, 0, 1.0, 0, 0), drafts)])
        elif kind == "speculate":  # a rows pick bucket a: one live row on the dummy pages, the rest empty
            n_tok = 1 + self.spec_k
            live = Chunk([0] * n_tok, 0, pages, (1.0 if rest[0] else 0.0, 0, 1.0, 0, 0))
            self.speculate([live] + [Chunk([0] * n_tok, 0, [], GREEDY)] * (a - 1))
        else:  # a tokens pick bucket a
            row = Chunk([0] * a, 0, pages, (1.0, 0, 1.0, 0, 0) if kind == "step-sampled" else GREEDY)
            self.step([row], True, [[0] * a] if kind == "score" else [])

    def time_steps(self, reps: int = 5) -> dict[str, dict[int, float]]:
        """Seconds (the fastest of `reps`) of a decode step by its rows ("plain") and of a prompt-lookup
        verify step by its real tokens ("spec": rows of 1 + k tokens), on the dummy page, after
        warm-up: the cost table that adaptive speculation (engine/spec_policy.py) starts from."""
        pages = [DUMMY_PAGE] * self.max_pages_per_seq
        cap = self.token_buckets[-1]
        rows_list = [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= min(self.cfg.max_slots, cap)]
        k = self.spec_k
        sizes = sorted(
            {t for t in (2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64) if t <= min(cap, self.cfg.max_slots * (k + 1))}
        )

        jobs: dict[tuple[str, int], Callable] = {}
        for b in rows_list:
            jobs["plain", b] = lambda b=b: self.step([Chunk([0], 0, pages, GREEDY)] * b)
        for t in sizes:
            rows, left = [], t
            while left:
                n = min(left, k + 1)
                rows.append(Chunk([0] * n, 0, pages, GREEDY, n - 1))
                left -= n
            jobs["spec", t] = lambda rows=rows: self.speculate_ragged(rows)
        best = {key: float("inf") for key in jobs}
        for _ in range(reps):  # interleaved, the fastest of each: a busy host's drift hits all alike
            for key, fn in jobs.items():
                t0 = time.perf_counter()
                fn()
                best[key] = min(best[key], time.perf_counter() - t0)
        plain = {b: best["plain", b] for b in rows_list}
        spec = {t: best["spec", t] for t in sizes}
        return {"plain": plain, "spec": spec}

    def wait_for_huge_pages(self) -> None:
        """Until every model's buffers are on huge pages (host_memory: collapsing runs in the
        background from start; warm-up ends with this)."""
        for w in self.models:
            w.huge_pages.join()


def _index_pairs(pairs: list, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(src, dst) index arrays of a fixed size, padded with dummy-to-dummy copies."""
    src, dst = np.zeros((size,), np.int32), np.zeros((size,), np.int32)
    src[: len(pairs)] = [a for a, _ in pairs]
    dst[: len(pairs)] = [b for _, b in pairs]
    return src, dst


def _compile_threads() -> int:
    """$JAXSERVE_COMPILE_THREADS, else one thread per CPU this process may use, at most 8."""
    value = os.environ.get("JAXSERVE_COMPILE_THREADS", "")
    if not value:
        return min(len(os.sched_getaffinity(0)), 8)
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"JAXSERVE_COMPILE_THREADS: expected a whole number of threads >= 1, got {value!r}")
    return int(value)
