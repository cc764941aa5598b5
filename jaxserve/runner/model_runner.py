"""The device side: jitted prefill, decode, speculative and page-copy steps over fixed shapes.

Pure functions of arrays, jitted with the model graph and config static and the KV cache
donated. The runner never sees a request: it takes `step_batch.Chunk`s (token ids, a start
position, a block table, sampling controls), turns them into one padded `StepBatch` and
runs it. Every dynamic size is padded to a bucket, so warm-up compiles everything serving
will ever run.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import logging
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve import kv_math
from jaxserve.models.model_config import ModelConfig
from jaxserve.parallel.multihost import to_host
from jaxserve.runner import host_memory, sampling, step_batch
from jaxserve.runner.executable_cache import ExecutableStore, Step
from jaxserve.runner.sampling import sample
from jaxserve.runner.step_batch import DUMMY_PAGE, Chunk, StepBatch
from pallas_kernels import reference

log = logging.getLogger("jaxserve.runner")


def pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return tuple(out)


def bucket_for(buckets: tuple[int, ...], n: int) -> int:
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


def _attention_fn(impl: str, interpret: bool, mode: str) -> Callable:
    """The attention of one step kind: "prefill" (fresh prompt), "context" (a chunk that
    continues a sequence) or "decode"."""
    if impl == "xla":
        return functools.partial(reference.attention, mode=mode)
    if impl == "native":
        from pallas_kernels import native

        return functools.partial(native.attention, mode=mode)
    from pallas_kernels import paged_attention as pk

    return functools.partial(pk.attention, mode=mode, interpret=interpret)


def default_attention(backend: str) -> str:
    """Pallas on TPU/GPU; on the CPU the native FFI kernel where it is built, else XLA."""
    if backend != "cpu":
        return "pallas"
    from pallas_kernels import native

    return "native" if native.available() else "xla"


def default_argmax(mesh) -> Callable:
    """Greedy sampling's argmax: on the CPU without a mesh the native one-pass kernel (a custom
    call, which XLA cannot split across chips), where it is built; else sampling.argmax. Both
    give the first index of the row maximum."""
    if mesh is None and jax.default_backend() == "cpu":
        from pallas_kernels import native_argmax

        if native_argmax.available():
            return native_argmax.argmax
    return sampling.argmax


def _prefill_step(graphdef, attn_fn, params, kv, batch: StepBatch):
    model = nnx.merge(graphdef, params)
    _, kv = model(
        batch.tokens, batch.positions, kv, batch.attn, attn_fn, logits_index=jnp.zeros((batch.num_rows,), jnp.int32)
    )
    return kv  # logits unused: XLA drops the vocabulary projection


def _prefill_logprobs_step(graphdef, attn_fn, params, kv, batch: StepBatch, targets, *, num_top: int):
    """A prefill that also scores the chunk (prompt logprobs, lm-eval's loglikelihood): the
    log-softmax of every position's logits, gathered at `targets` [S, T] (each position's next
    prompt token), its rank in the vocabulary (1: the most likely) and the top `num_top`.
    A step of its own so the plain prefill keeps dropping the vocabulary projection. Returns
    (kv, (logprob [S, T], rank [S, T], top ids [S, T, n], top logprobs [S, T, n]))."""
    model = nnx.merge(graphdef, params)
    logits, kv = model(batch.tokens, batch.positions, kv, batch.attn, attn_fn)
    logp = jax.nn.log_softmax(logits, axis=-1)  # float32, as the decode step's logprobs
    chosen = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    rank = 1 + jnp.sum(logp > chosen[..., None], axis=-1, dtype=jnp.int32)
    top_lp, top_ids = jax.lax.top_k(logp, num_top)
    return kv, (chosen, rank, top_ids.astype(jnp.int32), top_lp)


def _decode_step(graphdef, attn_fn, params, kv, batch: StepBatch):
    """One token per row: (logits [S, V], kv). Serving runs `_decode_sample_step`."""
    model = nnx.merge(graphdef, params)
    return model(
        batch.tokens, batch.positions, kv, batch.attn, attn_fn, logits_index=jnp.zeros((batch.num_rows,), jnp.int32)
    )


def _decode_sample_step(
    graphdef,
    attn_fn,
    params,
    kv,
    batch: StepBatch,
    prev_tokens,
    *,
    do_sample: bool,
    num_logprobs: int,
    argmax_fn: Callable = sampling.argmax,
):
    """The decode step serving runs: one token per row, sampled in the same jitted call (every
    sampling control and the grammar bitmask are batch fields), so only the sampled ids and
    logprobs leave the device. A row with batch.feed >= 0 takes its input token from the
    previous step's sampled ids (`prev_tokens`, one fixed-size buffer), so the host can
    dispatch this step before it has read them. Returns (kv, (tokens, chosen logprob, top
    ids, top logprobs), this step's sampled ids padded to prev_tokens' size)."""
    fed = jnp.where(batch.feed >= 0, prev_tokens[jnp.maximum(batch.feed, 0)], batch.tokens[:, 0])
    batch = dataclasses.replace(batch, tokens=fed[:, None])
    logits, kv = _decode_step(graphdef, attn_fn, params, kv, batch)
    out = sample(
        logits, batch.sampling, batch.bitmask, do_sample=do_sample, num_logprobs=num_logprobs, argmax_fn=argmax_fn
    )
    return kv, out, jnp.zeros_like(prev_tokens).at[: batch.num_rows].set(out[0])


def _copy_pages(kv, src, dst):
    """Copy pages src -> dst in every array of every layer's cache tuple (scales too)."""
    return tuple(tuple(x.at[dst].set(x[src]) for x in layer) for layer in kv)


@dataclasses.dataclass
class PromptLogprobs:
    """One prefill chunk's scores: position j's next token (the chunk's target j) has
    `logprobs[j]` and vocabulary rank `ranks[j]`; top_ids/top_logprobs [m, n] the n most likely."""

    logprobs: np.ndarray  # [m]
    ranks: np.ndarray  # [m]
    top_ids: np.ndarray  # [m, n]
    top_logprobs: np.ndarray  # [m, n]


@dataclasses.dataclass
class DecodeResult:
    tokens: np.ndarray  # [S]
    logprobs: np.ndarray | None  # [S]
    top_ids: np.ndarray | None  # [S, n]
    top_logprobs: np.ndarray | None


@dataclasses.dataclass
class PendingDecode:
    """A dispatched decode step whose results are still on the device (JAX dispatches
    asynchronously): `result()` waits for them and copies them to the host."""

    outputs: tuple  # device arrays in batch-row order
    inverse: np.ndarray  # caller's row i is batch row inverse[i]

    def result(self) -> DecodeResult:
        return DecodeResult(*(None if x is None else to_host(x)[self.inverse] for x in self.outputs))


def replicated(method: Callable) -> Callable:
    """A runner call every process must make: with several processes, the leader first
    hands its host inputs to the others (multihost.StepBroadcaster)."""

    @functools.wraps(method)
    def wrapper(self, *args):
        if self.broadcaster is not None and self.broadcaster.leader:
            self.broadcaster.send(method.__name__, args)
        return method(self, *args)

    return wrapper


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
    The target and a speculative draft each have one; both use the same page ids."""

    def __init__(
        self,
        name: str,
        module: nnx.Module,
        cfg: ModelConfig,
        num_pages: int,
        page_size: int,
        dtype,
        attention_impl: str,
        interpret: bool,
        mesh=None,
        store: ExecutableStore | None = None,
        kv_cache_dtype: str = "auto",
        matmul_impl: str = "xla",
        matmul_dtype: str = "float32",
    ):
        self.cfg = cfg
        if matmul_impl == "native":  # resolve() never picks it under tensor parallelism
            from jaxserve.models.linear import pack_native

            pack_native(module, matmul_dtype)
        self.graphdef, self.params = nnx.split(module)
        self.kv_sharding = None
        if mesh is not None:
            from jax.sharding import NamedSharding

            from jaxserve.parallel import sharding as shd

            self.params = shd.shard_params(self.params, cfg, mesh)
            self.kv_sharding = shd.kv_sharding(cfg, mesh, quantized=kv_cache_dtype != "auto")
        layer = functools.partial(
            reference.empty_kv_cache, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, dtype, kv_cache_dtype
        )
        zeros = jax.jit(lambda: tuple(layer() for _ in range(cfg.num_layers)), out_shardings=self.kv_sharding)
        self.kv = zeros()
        self.huge_pages = host_memory.advise_huge_pages_in_background((self.params, self.kv))  # CPU buffers only
        self.attn = {m: _attention_fn(attention_impl, interpret, m) for m in ("prefill", "context", "decode")}
        self.argmax = default_argmax(mesh)
        if mesh is not None and attention_impl in ("pallas", "native"):  # custom calls XLA cannot split
            from jaxserve.parallel import sharding as shd

            self.attn = {m: shd.shard_attention(fn, cfg, mesh) for m, fn in self.attn.items()}
        step = lambda fn, mode, kv_out: Step(
            f"{name}-{fn.__name__.strip('_')}-{mode}",
            jax.jit(  # noqa: E731
                pin_kv(functools.partial(fn, self.graphdef, self.attn[mode]), self.kv_sharding, kv_out),
                donate_argnums=(1,),
            ),
            store,
            fixed=2,
        )
        self.prefill = step(_prefill_step, "prefill", None)
        self.prefill_ctx = step(_prefill_step, "context", None)
        self.prefill_logprobs = Step(  # the target's only: the draft fills KV with prefill_ctx
            f"{name}-prefill-logprobs",
            jax.jit(
                pin_kv(
                    functools.partial(_prefill_logprobs_step, self.graphdef, self.attn["context"]),
                    self.kv_sharding,
                    0,
                    None,
                ),
                donate_argnums=(1,),
                static_argnames=("num_top",),
            ),
            store,
            fixed=2,
        )
        self.decode = step(_decode_step, "decode", 1)  # logits only (tests, tools): not warmed up
        replicate = None
        if mesh is not None:
            from jax.sharding import NamedSharding, PartitionSpec

            replicate = NamedSharding(mesh, PartitionSpec())
        self.decode_sample = Step(
            f"{name}-decode-sample",
            jax.jit(
                pin_kv(
                    functools.partial(_decode_sample_step, self.graphdef, self.attn["decode"], argmax_fn=self.argmax),
                    self.kv_sharding,
                    0,
                    replicate,
                ),
                donate_argnums=(1,),
                static_argnames=("do_sample", "num_logprobs"),
            ),
            store,
            fixed=2,
        )
        self.copy = Step(
            f"{name}-copy", jax.jit(pin_kv(_copy_pages, self.kv_sharding, None), donate_argnums=(0,)), store, fixed=1
        )


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    """What the runner needs of the engine's options, resolved for this backend."""

    max_slots: int
    page_size: int
    max_model_len: int
    num_pages: int
    prefill_buckets: tuple[int, ...]
    dtype: str
    attention_impl: str
    interpret: bool
    kv_cache_dtype: str = "auto"  # "auto" (pages in dtype) | "int8" | "fp8" (8-bit pages + bfloat16 scales)
    matmul_impl: str = "xla"  # "native": Linear weights packed for the C++ CPU matmul
    matmul_dtype: str = "float32"  # the native matmul's float weights: "float32" | "bfloat16" (AMX tiles)
    matmul_reason: str = ""  # why that matmul_impl / matmul_dtype (the start-up log, model info)
    max_logprobs: int = 0  # the top-n alternatives a decode step computes when any row asks for logprobs
    prompt_logprobs: bool = True  # warm up the scoring prefill (prompt logprobs)
    num_speculative_tokens: int = 0  # k of a speculative step; 0 = no speculation
    tensor_parallel_size: int = 1
    # Decode batch buckets are powers of two from 8 rows (on TPU/GPU a sublane tile: fewer rows
    # cost the same). On the CPU every padded row costs its share of the matmuls, so a lone
    # request (the latency case, and speculative verification at batch 1) gets a bucket of one
    # row; 2-7 rows still pad to 8 (each bucket is 4 more executables to compile at start).
    single_row_bucket: bool = False
    store_context: str | None = None  # with compilation_cache_dir: the key of the executable store
    compilation_cache_dir: str | None = None


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
        self.prefill_buckets = cfg.prefill_buckets
        self.num_pages = cfg.num_pages
        self.mesh = None
        if cfg.tensor_parallel_size > 1:
            from jaxserve.parallel import sharding as shd

            for c in (model_cfg, draft_cfg):
                if c is not None:
                    shd.check_divisible(c, cfg.tensor_parallel_size)
            self.mesh = shd.make_mesh(cfg.tensor_parallel_size)
        from jaxserve.parallel import multihost

        self.broadcaster = multihost.StepBroadcaster() if multihost.is_multiprocess() else None
        self.store = None  # compiled steps kept across restarts; with several processes JAX's cache does it
        if cfg.compilation_cache_dir and self.broadcaster is None:
            try:
                devices = list(self.mesh.devices.flat) if self.mesh is not None else None  # None: the default device
                self.store = ExecutableStore(cfg.compilation_cache_dir, cfg.store_context or repr(cfg), devices)
            except OSError as e:
                log.warning("compiled steps are not kept across restarts: %s", e)
        build = lambda n, m, c: _Weights(
            n,
            m,
            c,
            self.num_pages,
            ps,
            self.dtype,
            self.attention_impl,  # noqa: E731
            cfg.interpret,
            self.mesh,
            self.store,
            kv_cache_dtype=cfg.kv_cache_dtype,
            matmul_impl=cfg.matmul_impl,
            matmul_dtype=cfg.matmul_dtype,
        )
        self.target = build("target", model, model_cfg)
        self.draft = build("draft", draft, draft_cfg) if draft is not None else None
        self.models = [w for w in (self.target, self.draft) if w is not None]
        self.copy_batch = max(8, cfg.max_slots)
        # Decode runs over the live sequences only, padded to a power-of-two batch: the slot
        # a request holds is host bookkeeping, the device addresses KV through pages.
        self.batch_buckets = pow2_buckets(min(8, cfg.max_slots), cfg.max_slots)
        if cfg.single_row_bucket and self.batch_buckets[0] > 1:
            self.batch_buckets = (1, *self.batch_buckets)
        # The previous decode step's sampled ids, on the device, and where each of its rows
        # sits in them: the next step reads its input tokens from here (decode_async's feed).
        self._prev_tokens = jnp.zeros((self.batch_buckets[-1],), jnp.int32)
        if self.mesh is not None:
            from jax.sharding import NamedSharding, PartitionSpec

            self._prev_tokens = jax.device_put(self._prev_tokens, NamedSharding(self.mesh, PartitionSpec()))
        self._prev_row: list[int] = []
        self.spec_k = cfg.num_speculative_tokens
        if self.spec_k:
            from jaxserve.runner import speculative

            t = self.target
            self._verify = Step(
                "verify",
                jax.jit(
                    pin_kv(
                        functools.partial(speculative.verify, t.graphdef, t.attn["context"], argmax_fn=t.argmax),
                        t.kv_sharding,
                        0,
                    ),
                    donate_argnums=(1,),
                    static_argnames=("do_sample",),
                ),
                self.store,
                fixed=2,
            )
            if self.draft is not None:
                d = self.draft
                self._propose = Step(
                    "propose",
                    jax.jit(
                        pin_kv(
                            functools.partial(
                                speculative.draft_propose, d.graphdef, d.attn["decode"], argmax_fn=d.argmax
                            ),
                            d.kv_sharding,
                            0,
                        ),
                        donate_argnums=(1,),
                        static_argnames=("do_sample",),
                    ),
                    self.store,
                    fixed=2,
                )

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

    def batch(self, rows: Sequence[Sequence[Chunk]], num_rows: int, num_tokens: int, table_width: int) -> StepBatch:
        return step_batch.build(
            rows,
            num_rows=num_rows,
            num_tokens=num_tokens,
            table_width=table_width,
            page_size=self.cfg.page_size,
            vocab_size=self.model_cfg.vocab_size,
        )

    # -- steps -------------------------------------------------------------------------
    @replicated
    def prefill(self, chunks: list[Chunk], targets: Sequence[Sequence[int] | None] = ()) -> list[PromptLogprobs | None]:
        """Fill KV (of the target and the draft) for chunks of a sequence's tokens.

        Fresh prompts (start 0) are packed into one row of a bucket, each its own segment,
        so short prompts share one call and padding stays below one bucket step. A chunk that
        continues a sequence runs alone and attends to the pages already written.

        targets[i] (optional): the token after each of chunk i's tokens. Such a chunk runs
        alone through the scoring prefill (`_prefill_logprobs_step`, the continuation
        attention: it also serves a chunk at start 0), and result i is its PromptLogprobs;
        the others' results are None."""
        targets = list(targets) + [None] * (len(chunks) - len(targets))
        results: list[PromptLogprobs | None] = [None] * len(chunks)
        for i, c in enumerate(chunks):
            if targets[i] is not None:
                results[i] = self._run_prefill_logprobs(c, targets[i])
        chunks = [c for c, t in zip(chunks, targets) if t is None]
        for c in chunks:
            if c.start:
                self._run_prefill([c], "prefill_ctx", self.table_width)
        cap = self.prefill_buckets[-1]
        pack, used = [], 0
        for c in (c for c in chunks if c.start == 0):
            if used + len(c.tokens) > cap:
                self._run_prefill(pack, "prefill", 1)
                pack, used = [], 0
            pack.append(c)
            used += len(c.tokens)
        if pack:
            self._run_prefill(pack, "prefill", 1)
        return results

    def _run_prefill_logprobs(self, chunk: Chunk, targets: Sequence[int]) -> PromptLogprobs:
        m = len(chunk.tokens)
        if len(targets) != m:
            raise ValueError(f"targets: {len(targets)} for a chunk of {m} tokens")
        t = bucket_for(self.prefill_buckets, m)
        batch = self.batch([[chunk]], 1, t, self.table_width)
        padded = np.zeros((1, t), np.int32)
        padded[0, :m] = targets
        w = self.target
        w.kv, out = w.prefill_logprobs(w.params, w.kv, batch, padded, num_top=max(1, self.cfg.max_logprobs))
        if self.draft is not None:
            self.draft.kv = self.draft.prefill_ctx(self.draft.params, self.draft.kv, batch)
        lp, rank, top_ids, top_lp = (to_host(x)[0, :m] for x in out)
        return PromptLogprobs(lp, rank, top_ids, top_lp)

    def _run_prefill(self, chunks: list[Chunk], fn_name: str, table_width: int) -> None:
        t = bucket_for(self.prefill_buckets, sum(len(c.tokens) for c in chunks))
        batch = self.batch([chunks], 1, t, table_width)
        for w in self.models:
            w.kv = getattr(w, fn_name)(w.params, w.kv, batch)

    def _decode_batch(self, rows: list[Chunk], num_tokens: int) -> tuple[list[int], StepBatch]:
        """Rows sorted by context length, longest first (the attention groups rows by length),
        padded to a batch bucket. Returns (row order, batch): batch row i is rows[order[i]]."""
        order = sorted(range(len(rows)), key=lambda i: -(rows[i].start + 1))
        s = bucket_for(self.batch_buckets, len(rows))
        return order, self.batch([[rows[i]] for i in order], s, num_tokens, self.table_width)

    def decode(self, rows: list[Chunk], num_logprobs: int) -> DecodeResult:
        """One step of the target over one token per row, sampled in the same device call; row
        i of the result is rows[i]. num_logprobs: 0, or cfg.max_logprobs (the one static top-n
        the sampler compiles)."""
        return self.decode_async(rows, num_logprobs).result()

    @replicated
    def decode_async(self, rows: list[Chunk], num_logprobs: int, feed: Sequence[int] = ()) -> PendingDecode:
        """`decode` without waiting for the device. feed[i] >= 0: row i's input token is the one
        the previous decode_async call sampled for its row feed[i] (rows[i].tokens is ignored),
        read on the device, so this step can be dispatched before the host knows that token."""
        order, batch = self._decode_batch(rows, 1)
        if any(f >= 0 for f in feed):
            batch.feed[: len(rows)] = [self._prev_row[feed[i]] if feed[i] >= 0 else -1 for i in order]
        t = self.target
        do_sample = bool(np.any(batch.active & (batch.sampling.temperature > 0)))
        t.kv, out, self._prev_tokens = t.decode_sample(
            t.params, t.kv, batch, self._prev_tokens, do_sample=do_sample, num_logprobs=num_logprobs
        )
        inverse = np.argsort(order)
        self._prev_row = inverse.tolist()
        return PendingDecode(out, inverse)

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
        order, batch = self._decode_batch(rows, k + 1)
        do_sample = bool(np.any(batch.active & (batch.sampling.temperature > 0)))
        drafts, q = None, None
        if self.draft is not None:
            d = self.draft
            d.kv, drafts, q = self._propose(d.params, d.kv, batch, do_sample=do_sample)
        t = self.target
        t.kv, out, n_out = self._verify(t.params, t.kv, batch, drafts, q, do_sample=do_sample)
        inverse = np.argsort(order)
        num_drafts = np.asarray([c.num_drafts for c in rows], np.int32)
        return to_host(out)[inverse], to_host(n_out)[inverse], num_drafts

    @replicated
    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        for i in range(0, len(pairs), self.copy_batch):
            chunk = pairs[i : i + self.copy_batch]
            src = np.zeros((self.copy_batch,), np.int32)
            dst = np.zeros((self.copy_batch,), np.int32)
            src[: len(chunk)] = [a for a, _ in chunk]
            dst[: len(chunk)] = [b for _, b in chunk]
            for w in self.models:
                w.kv = w.copy(w.kv, src, dst)

    # -- warm-up -----------------------------------------------------------------------
    def warmup(self, progress: Callable[[str], None] | None = None) -> float:
        """Compile every shape serving can produce; all writes go to the dummy page."""
        t0 = time.perf_counter()
        ps = self.cfg.page_size
        jobs = [("prefill", t, start) for t in self.prefill_buckets for start in (0, ps)]
        if self.cfg.prompt_logprobs:
            jobs += [("prefill_logprobs", t, 0) for t in self.prefill_buckets]
        for b in self.batch_buckets:
            jobs += [("decode", b, (do_sample, nlp)) for do_sample in (False, True) for nlp in (0, 1)]
            if self.spec_k:
                jobs += [("speculate", b, (do_sample, 0)) for do_sample in (False, True)]
        for i, (kind, a, b) in enumerate(jobs):
            if progress:
                progress(f"compiling {kind} {a} {b if b is not None else ''} ({i + 1}/{len(jobs)})")
            if kind == "prefill":
                self.prefill([Chunk([0] * a, b, [DUMMY_PAGE] * (self.max_pages_per_seq + a // ps + 2))])
                continue
            if kind == "prefill_logprobs":
                self.prefill([Chunk([0] * a, 0, [DUMMY_PAGE] * (self.max_pages_per_seq + a // ps + 2))], [[0] * a])
                continue
            # a rows pick bucket a: one live row on the dummy pages, the rest empty
            n_tok = 1 + self.spec_k if kind == "speculate" else 1
            live = Chunk([0] * n_tok, 0, [DUMMY_PAGE] * self.max_pages_per_seq, (1.0 if b[0] else 0.0, 0, 1.0, 0, 0))
            rows = [live] + [Chunk([0] * n_tok, 0, [], (0.0, 0, 1.0, 0, 0))] * (a - 1)
            if kind == "decode":
                self.decode(rows, self.cfg.max_logprobs if b[1] else 0)
            else:
                self.speculate(rows)
        self.copy_pages([(DUMMY_PAGE, DUMMY_PAGE)])
        jax.block_until_ready([w.kv for w in self.models])
        self.wait_for_huge_pages()
        return time.perf_counter() - t0

    def wait_for_huge_pages(self) -> None:
        """Until every model's buffers are on huge pages (host_memory: collapsing runs in the
        background from start; warm-up ends with this)."""
        for w in self.models:
            w.huge_pages.join()


def resolve(
    model_cfg: ModelConfig, draft_cfg: ModelConfig | None, engine_cfg, weight_bytes: int, max_logprobs: int
) -> RunnerConfig:
    """The engine's options resolved for this backend and model: dtype, attention, the pool
    size (from memory and kv-math), buckets. Raises ValueError when one max-length request
    cannot fit."""
    backend = jax.default_backend()
    cfg = engine_cfg
    dtype = jnp.dtype(cfg.dtype or ("float32" if backend == "cpu" else "bfloat16"))
    max_model_len = min(cfg.max_model_len or min(model_cfg.max_context, 2048), model_cfg.max_context)
    ps = cfg.page_size
    max_pages_per_seq = -(-max_model_len // ps)
    fits = [b for b in cfg.prefill_buckets if b < max_model_len]
    bigger = [b for b in cfg.prefill_buckets if b >= max_model_len]
    kv_cache_dtype = cfg.kv_cache_dtype
    bytes_per_token = kv_bytes_per_token(dtype.name, model_cfg, draft_cfg, kv_cache_dtype=kv_cache_dtype)
    num_pages = cfg.num_pages or _pool_pages(cfg, ps * bytes_per_token, max_pages_per_seq, weight_bytes)
    if num_pages < max_pages_per_seq + 1:
        raise ValueError(
            f"KV cache too small: one request of max_model_len={max_model_len} needs "
            f"{max_pages_per_seq} pages of {ps} tokens ({max_pages_per_seq * ps * bytes_per_token / 2**20:.1f} MiB "
            f"at {bytes_per_token} bytes/token) plus the reserved page, but the pool has {num_pages} "
            f"pages; raise num_pages / kv_cache_memory_bytes or lower max_model_len"
        )
    if cfg.attention_impl == "native":
        from pallas_kernels import native

        if backend != "cpu" or not native.available():
            why = "it runs on the CPU only" if backend != "cpu" else native.unavailable_reason()
            raise ValueError(f"attention_impl='native' is unavailable here: {why}")
    attention_impl = cfg.attention_impl or default_attention(backend)
    if kv_cache_dtype == "fp8" and attention_impl == "native":
        if cfg.attention_impl == "native":
            raise ValueError(
                "kv_cache_dtype='fp8' is not supported by attention_impl='native' (the CPU kernel reads "
                "int8 pages); use kv_cache_dtype='int8' or attention_impl='xla'"
            )
        attention_impl = "xla"  # the CPU default falls back to the XLA path, which reads fp8 pages
    matmul_impl = _resolve_matmul(cfg, backend)
    matmul_dtype, matmul_reason = _resolve_matmul_dtype(cfg, matmul_impl)
    spec_k = cfg.num_speculative_tokens if cfg.speculative_model else 0
    return RunnerConfig(
        max_slots=cfg.max_slots,
        page_size=ps,
        max_model_len=max_model_len,
        num_pages=num_pages,
        prefill_buckets=tuple(fits + bigger[:1]),
        dtype=dtype.name,
        attention_impl=attention_impl,
        interpret=cfg.interpret if cfg.interpret is not None else backend == "cpu",
        kv_cache_dtype=kv_cache_dtype,
        matmul_impl=matmul_impl,
        matmul_dtype=matmul_dtype,
        matmul_reason=matmul_reason,
        max_logprobs=min(max_logprobs, model_cfg.vocab_size),
        prompt_logprobs=cfg.enable_prompt_logprobs,
        num_speculative_tokens=spec_k,
        tensor_parallel_size=cfg.tensor_parallel_size,
        single_row_bucket=backend == "cpu",
        compilation_cache_dir=cfg.compilation_cache_dir,
        # what the executables were compiled for, as resolved here (packed weights or not)
        store_context=f"{dataclasses.replace(cfg, compilation_cache_dir=None)!r} {model_cfg!r} {draft_cfg!r} "
        f"matmul={matmul_impl}-{matmul_dtype}",
    )


def _resolve_matmul(cfg, backend: str) -> str:
    """The native matmul on the CPU where it is built and the model is not split across chips
    (XLA's partitioner cannot split a custom call); XLA's dot otherwise."""
    from pallas_kernels import native_matmul

    if cfg.matmul_impl == "native":
        if backend != "cpu" or not native_matmul.available():
            why = "it runs on the CPU only" if backend != "cpu" else native_matmul.unavailable_reason()
            raise ValueError(f"matmul_impl='native' is unavailable here: {why}")
        if cfg.tensor_parallel_size > 1:
            raise ValueError("matmul_impl='native' cannot be split across chips; use tensor_parallel_size=1 or 'xla'")
        return "native"
    if cfg.matmul_impl is None and backend == "cpu" and cfg.tensor_parallel_size == 1 and native_matmul.available():
        return "native"
    return "xla"


def _resolve_matmul_dtype(cfg, matmul_impl: str) -> tuple[str, str]:
    """The native matmul's float weights and why: bfloat16 on the AMX tiles by default where the
    CPU has them and the user left ``dtype`` unset (an explicit dtype="float32" keeps today's
    exact path); float32 otherwise. An explicit matmul_dtype="bfloat16" the host cannot run is
    refused (ValueError naming the field)."""
    from pallas_kernels import native_matmul

    if matmul_impl != "native":
        if cfg.matmul_dtype == "bfloat16":
            raise ValueError("matmul_dtype='bfloat16' needs the native CPU matmul (matmul_impl='native')")
        return "float32", f"matmul_impl={matmul_impl}"
    why_not = native_matmul.bf16_unavailable_reason()
    if cfg.matmul_dtype == "bfloat16":
        if why_not:
            raise ValueError(f"matmul_dtype='bfloat16' is unavailable here: {why_not}")
        return "bfloat16", "matmul_dtype='bfloat16' (AMX tiles)"
    if cfg.matmul_dtype == "float32":
        return "float32", "matmul_dtype='float32'"
    if cfg.dtype is not None:
        return "float32", f"dtype={cfg.dtype!r} given (matmul_dtype='bfloat16' for the AMX tiles)"
    if why_not:
        return "float32", why_not
    return "bfloat16", "default on a CPU with AMX bf16 tiles (matmul_dtype='float32' for the exact float32 path)"


def kv_bytes_per_token(dtype: str, *cfgs: ModelConfig | None, kv_cache_dtype: str = "auto") -> int:
    """KV bytes one token takes in the pool, the target's and a draft's together; an 8-bit
    cache ("int8" / "fp8") counts its bfloat16 per-token-per-head scales too."""
    kv = _KV_DTYPE[dtype] if kv_cache_dtype == "auto" else kv_cache_dtype
    return sum(kv_math.kv_bytes_per_token(c.shape(), kv_dtype=kv) for c in cfgs if c is not None)


def _pool_pages(cfg, bytes_per_page: int, max_pages_per_seq: int, weight_bytes: int) -> int:
    budget = cfg.kv_cache_memory_bytes
    if budget is None:
        stats = jax.local_devices()[0].memory_stats() or {}  # every process: its own chips
        if "bytes_limit" in stats:
            budget = int(stats["bytes_limit"] * cfg.memory_fraction) - weight_bytes - stats.get("bytes_in_use", 0)
        else:  # CPU: enough for every slot at full length, at most 2 GiB
            budget = min(2 << 30, (cfg.max_slots * max_pages_per_seq + 1) * bytes_per_page)
    return max(0, budget // bytes_per_page)


_KV_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
