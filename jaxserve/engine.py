"""The device side: jitted prefill, decode and page-copy steps over fixed shapes.

Pure functions of arrays, jitted with the model graph and config static and the KV cache
donated. The engine never sees a request: it takes token ids, positions, page ids and
sampling arrays, and every dynamic size is padded to a bucket so that warm-up compiles
everything serving will ever run.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import logging
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve import kv_math
from jaxserve.executable_cache import ExecutableStore, Step, compile_count, trace_count  # noqa: F401 (re-exported)
from jaxserve.multihost import to_host
from jaxserve.models.config import ModelConfig
from jaxserve.models.llama import AttentionMetadata, LlamaForCausalLM
from jaxserve.paged_cache import DUMMY_PAGE
from jaxserve.request import MAX_LOGPROBS
from jaxserve.sampling import sample
from pallas_kernels import reference

log = logging.getLogger("jaxserve.engine")

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


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_slots: int = 16
    page_size: int = 16
    max_model_len: int | None = None  # default: the model's context, capped at 2048
    num_pages: int | None = None  # default: sized from kv_cache_memory_bytes
    kv_cache_memory_bytes: int | None = None  # default: accelerator memory left, or 2 GiB on CPU
    memory_fraction: float = 0.9
    prefill_buckets: tuple[int, ...] = (16, 32, 64, 128, 256, 512)
    max_prefill_tokens: int = 512  # per scheduler step, across sequences
    dtype: str | None = None  # "float32" | "bfloat16"; default by backend
    attention_impl: str | None = None  # "xla" | "pallas"; default pallas on TPU/GPU, xla on CPU
    interpret: bool | None = None  # run Pallas kernels interpreted (default: on CPU)
    enable_prefix_caching: bool = True
    speculative_model: str | None = None  # a draft checkpoint directory, or "ngram" (prompt lookup)
    num_speculative_tokens: int = 4
    tensor_parallel_size: int = 1
    compilation_cache_dir: str | None = None  # persistent XLA cache: a restart skips compilation
    seed: int = 0

    def __post_init__(self):
        for name in ("max_slots", "page_size", "max_prefill_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.attention_impl not in (None, "xla", "pallas"):
            raise ValueError(f"attention_impl must be 'xla' or 'pallas', got {self.attention_impl!r}")
        if list(self.prefill_buckets) != sorted(set(self.prefill_buckets)) or self.prefill_buckets[0] < 1:
            raise ValueError(f"prefill_buckets must be increasing positive sizes, got {self.prefill_buckets}")


def _attention_fn(impl: str, interpret: bool, mode: str) -> Callable:
    """The attention of one step kind: "prefill" (fresh prompt), "context" (a chunk that
    continues a sequence) or "decode"."""
    if impl == "xla":
        return functools.partial(reference.attention, mode=mode)
    from pallas_kernels import paged_attention as pk

    return functools.partial(pk.attention, mode=mode, interpret=interpret)


def _prefill_step(graphdef, attn_fn, params, kv, tokens, positions, slot_mapping, block_tables, context_lens,
                  segment_ids):
    model = nnx.merge(graphdef, params)
    meta = AttentionMetadata(slot_mapping, block_tables, context_lens, segment_ids)
    _, kv = model(tokens, positions, kv, meta, attn_fn, logits_index=jnp.zeros((tokens.shape[0],), jnp.int32))
    return kv  # logits unused: XLA drops the vocabulary projection


def _decode_step(graphdef, attn_fn, params, kv, tokens, positions, slot_mapping, block_tables, context_lens):
    model = nnx.merge(graphdef, params)
    meta = AttentionMetadata(slot_mapping[:, None], block_tables, context_lens, jnp.zeros_like(slot_mapping)[:, None])
    logits, kv = model(tokens[:, None], positions[:, None], kv, meta, attn_fn,
                       logits_index=jnp.zeros((tokens.shape[0],), jnp.int32))
    return logits, kv


def _copy_pages(kv, src, dst):
    return tuple((k.at[dst].set(k[src]), v.at[dst].set(v[src])) for k, v in kv)


@dataclasses.dataclass
class DecodeResult:
    tokens: np.ndarray  # [S]
    logprobs: np.ndarray | None  # [S]
    top_ids: np.ndarray | None  # [S, n]
    top_logprobs: np.ndarray | None


def replicated(method: Callable) -> Callable:
    """An engine call every process must make: with several processes, the leader first
    hands its host inputs to the others (multihost.StepBroadcaster)."""

    @functools.wraps(method)
    def wrapper(self, *args):
        if self.broadcaster is not None and self.broadcaster.leader:
            self.broadcaster.send(method.__name__, args)
        return method(self, *args)

    return wrapper


def pin_kv(fn: Callable, sharding, kv_out: int | None) -> Callable:
    """Wrap a step so the KV cache it returns keeps `sharding` (tensor parallelism): the next
    call then sees the same input sharding, so donation holds and nothing recompiles."""
    if sharding is None:
        return fn

    def wrapped(*args, **kw):
        out = fn(*args, **kw)
        if kv_out is None:
            return jax.lax.with_sharding_constraint(out, sharding)
        out = list(out)
        out[kv_out] = jax.lax.with_sharding_constraint(out[kv_out], sharding)
        return tuple(out)

    return wrapped


class _Weights:
    """One model on the device: its parameters, its KV page pool and its jitted steps.
    The target and a speculative draft each have one; both use the same page ids."""

    def __init__(self, name: str, module: LlamaForCausalLM, cfg: ModelConfig, num_pages: int, page_size: int,
                 dtype, attention_impl: str, interpret: bool, mesh=None, store: ExecutableStore | None = None):
        self.cfg = cfg
        self.graphdef, self.params = nnx.split(module)
        shape = (num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_sharding = None
        if mesh is not None:
            from jax.sharding import NamedSharding

            from jaxserve import sharding as shd

            self.params = shd.shard_params(self.params, cfg, mesh)
            self.kv_sharding = NamedSharding(mesh, shd.kv_spec(cfg, mesh.shape[shd.AXIS]))
        zeros = jax.jit(lambda: tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.num_layers)),
                        out_shardings=self.kv_sharding)
        self.kv = zeros()
        self.attn = {m: _attention_fn(attention_impl, interpret, m) for m in ("prefill", "context", "decode")}
        if mesh is not None and attention_impl == "pallas":
            from jaxserve import sharding as shd

            self.attn = {m: shd.shard_attention(fn, cfg, mesh) for m, fn in self.attn.items()}
        step = lambda fn, mode, kv_out: Step(f"{name}-{fn.__name__.strip('_')}-{mode}", jax.jit(  # noqa: E731
            pin_kv(functools.partial(fn, self.graphdef, self.attn[mode]), self.kv_sharding, kv_out),
            donate_argnums=(1,)), store, fixed=2)
        self.prefill = step(_prefill_step, "prefill", None)
        self.prefill_ctx = step(_prefill_step, "context", None)
        self.decode = step(_decode_step, "decode", 1)
        self.copy = Step(f"{name}-copy", jax.jit(pin_kv(_copy_pages, self.kv_sharding, None), donate_argnums=(0,)),
                         store, fixed=1)


class Engine:
    def __init__(self, model: LlamaForCausalLM, model_cfg: ModelConfig, cfg: EngineConfig,
                 draft: LlamaForCausalLM | None = None, draft_cfg: ModelConfig | None = None):
        self.model_cfg = model_cfg
        self.cfg = cfg
        backend = jax.default_backend()
        self.dtype = jnp.dtype(cfg.dtype or ("float32" if backend == "cpu" else "bfloat16"))
        self.attention_impl = cfg.attention_impl or ("xla" if backend == "cpu" else "pallas")
        self.interpret = cfg.interpret if cfg.interpret is not None else backend == "cpu"
        self.max_model_len = min(cfg.max_model_len or min(model_cfg.max_context, 2048), model_cfg.max_context)
        ps = cfg.page_size
        self.max_pages_per_seq = -(-self.max_model_len // ps)
        # Block tables have one fixed width: the attention loop's trip count follows the
        # longest live context, so no per-length buckets (and compiles) are needed.
        self.table_width = -(-self.max_pages_per_seq // 2) * 2
        fits = [b for b in cfg.prefill_buckets if b < self.max_model_len]
        bigger = [b for b in cfg.prefill_buckets if b >= self.max_model_len]
        self.prefill_buckets = tuple(fits + bigger[:1])
        weight_bytes = sum(x.size * x.dtype.itemsize for m in (model, draft) if m is not None
                           for x in jax.tree.leaves(nnx.state(m)))
        kv_dtype = _KV_DTYPE[self.dtype.name]
        self.kv_bytes_per_token = sum(
            kv_math.kv_bytes_per_token(kv_math.ModelShape.from_hf_config(_shape_dict(c)), kv_dtype=kv_dtype)
            for c in (model_cfg, draft_cfg) if c is not None)
        self.num_pages = cfg.num_pages or self._size_pool(weight_bytes)
        if self.num_pages < self.max_pages_per_seq + 1:
            raise ValueError(
                f"KV cache too small: one request of max_model_len={self.max_model_len} needs "
                f"{self.max_pages_per_seq} pages of {ps} tokens ({self.max_pages_per_seq * ps * self.kv_bytes_per_token / 2**20:.1f} MiB "
                f"at {self.kv_bytes_per_token} bytes/token) plus the reserved page, but the pool has {self.num_pages} "
                f"pages; raise num_pages / kv_cache_memory_bytes or lower max_model_len")
        self.mesh = None
        self.broadcaster = None
        if cfg.tensor_parallel_size > 1:
            from jaxserve import sharding as shd

            for c in (model_cfg, draft_cfg):
                if c is not None:
                    shd.check_divisible(c, cfg.tensor_parallel_size)
            self.mesh = shd.make_mesh(cfg.tensor_parallel_size)
        from jaxserve import multihost

        self.broadcaster = multihost.StepBroadcaster() if multihost.is_multiprocess() else None
        self.store = None  # compiled steps kept across restarts; with several processes JAX's cache does it
        if cfg.compilation_cache_dir and self.broadcaster is None:
            context = (f"{dataclasses.replace(cfg, compilation_cache_dir=None)!r} {model_cfg!r} {draft_cfg!r} "
                       f"{self.dtype} {self.attention_impl} {self.interpret} {self.num_pages}")
            try:
                devices = list(self.mesh.devices.flat) if self.mesh is not None else None  # None: the default device
                self.store = ExecutableStore(cfg.compilation_cache_dir, context, devices)
            except OSError as e:
                log.warning("compiled steps are not kept across restarts: %s", e)
        build = lambda n, m, c: _Weights(n, m, c, self.num_pages, ps, self.dtype, self.attention_impl,  # noqa: E731
                                         self.interpret, self.mesh, self.store)
        self.target = build("target", model, model_cfg)
        self.draft = build("draft", draft, draft_cfg) if draft is not None else None
        self.models = [w for w in (self.target, self.draft) if w is not None]
        log.info("KV cache: %d pages x %d tokens (%.1f MiB), %d slots, max_model_len %d, attention %s",
                 self.num_pages, ps, self.num_pages * ps * self.kv_bytes_per_token / 2**20,
                 cfg.max_slots, self.max_model_len, self.attention_impl)
        replicate = None
        if self.mesh is not None:
            from jax.sharding import NamedSharding, PartitionSpec

            replicate = NamedSharding(self.mesh, PartitionSpec())
        self._sample = Step("sample", jax.jit(sample, static_argnames=("do_sample", "num_logprobs"),
                                              out_shardings=replicate), self.store)
        self.copy_batch = max(8, cfg.max_slots)
        # Decode runs over the live sequences only, padded to a power-of-two batch: the slot
        # a request holds is host bookkeeping, the device addresses KV through pages.
        self.batch_buckets = pow2_buckets(min(8, cfg.max_slots), cfg.max_slots)
        self.spec_k = cfg.num_speculative_tokens if cfg.speculative_model else 0
        if self.spec_k:
            from jaxserve import speculative

            t = self.target
            self._verify = Step("verify", jax.jit(
                pin_kv(functools.partial(speculative.verify, t.graphdef, t.attn["context"]), t.kv_sharding, 0),
                donate_argnums=(1,), static_argnames=("page_size", "do_sample")), self.store, fixed=2)
            if self.draft is not None:
                d = self.draft
                self._propose = Step("propose", jax.jit(
                    pin_kv(functools.partial(speculative.draft_propose, d.graphdef, d.attn["decode"]), d.kv_sharding, 0),
                    donate_argnums=(1,), static_argnames=("k", "page_size", "do_sample")), self.store, fixed=2)

    @property
    def kv(self):
        return self.target.kv

    def _size_pool(self, weight_bytes: int) -> int:
        per_page = self.cfg.page_size * self.kv_bytes_per_token
        budget = self.cfg.kv_cache_memory_bytes
        if budget is None:
            stats = jax.local_devices()[0].memory_stats() or {}  # every process: its own chips
            if "bytes_limit" in stats:
                budget = int(stats["bytes_limit"] * self.cfg.memory_fraction) - weight_bytes - stats.get("bytes_in_use", 0)
            else:  # CPU: enough for every slot at full length, at most 2 GiB
                budget = min(2 << 30, (self.cfg.max_slots * self.max_pages_per_seq + 1) * per_page)
        return max(0, budget // per_page)

    # -- steps -------------------------------------------------------------------------
    @replicated
    def prefill(self, chunks: list[tuple[list[int], int, list[int]]]) -> None:
        """Fill KV (of the target and the draft) for chunks of (tokens, start, the sequence's pages).

        Fresh prompts (start 0) are packed into one row of a bucket, each its own segment,
        so short prompts share one call and padding stays below one bucket step. A chunk that
        continues a sequence runs alone and attends to the pages already written."""
        fresh = [c for c in chunks if c[1] == 0]
        for tokens, start, pages in chunks:
            if start:
                self._run_prefill([(tokens, start, pages)], "prefill_ctx", self.table_width)
        cap = self.prefill_buckets[-1]
        pack, used = [], 0
        for c in fresh:
            if used + len(c[0]) > cap:
                self._run_prefill(pack, "prefill", 1)
                pack, used = [], 0
            pack.append(c)
            used += len(c[0])
        if pack:
            self._run_prefill(pack, "prefill", 1)

    def _run_prefill(self, chunks, fn_name: str, table_width: int) -> None:
        ps = self.cfg.page_size
        n = sum(len(c[0]) for c in chunks)
        t = bucket_for(self.prefill_buckets, n)
        tok = np.zeros((1, t), np.int32)
        pos = np.zeros((1, t), np.int32)
        slots = np.full((1, t), DUMMY_PAGE * ps, np.int32)
        seg = np.full((1, t), -1, np.int32)
        bt = np.full((1, table_width), DUMMY_PAGE, np.int32)
        off = 0
        for i, (tokens, start, pages) in enumerate(chunks):
            m = len(tokens)
            idx = np.arange(start, start + m)
            pages_arr = np.asarray(pages, np.int32)
            tok[0, off:off + m] = tokens
            pos[0, off:off + m] = idx
            slots[0, off:off + m] = pages_arr[idx // ps] * ps + idx % ps
            seg[0, off:off + m] = i
            off += m
        if table_width > 1:  # a continuation: one sequence, its whole table
            pages = chunks[0][2]
            bt[0, :min(table_width, len(pages))] = pages[:table_width]
        ctx = np.asarray([chunks[0][1] + len(chunks[0][0])], np.int32)
        for w in self.models:
            w.kv = getattr(w, fn_name)(w.params, w.kv, tok, pos, slots, bt, ctx, seg)

    def _tables(self, block_tables: list[list[int]], active: np.ndarray) -> np.ndarray:
        bt = np.zeros((len(active), self.table_width), np.int32)
        for i, (pages, a) in enumerate(zip(block_tables, active)):
            if a:
                bt[i, : len(pages)] = pages[: self.table_width]
        return bt

    @replicated
    def decode(self, tokens: np.ndarray, positions: np.ndarray, block_tables: list[list[int]], active: np.ndarray,
               temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, seeds: np.ndarray,
               counters: np.ndarray, num_logprobs: int) -> DecodeResult:
        """One step of the target over a batch of rows (a batch bucket); inactive rows write
        into the dummy page. Rows sorted by context length, longest first, attend fastest."""
        ps = self.cfg.page_size
        bt = self._tables(block_tables, active)
        slots = np.where(active, bt[np.arange(len(bt)), positions // ps] * ps + positions % ps, 0).astype(np.int32)
        ctx = np.where(active, positions + 1, 0).astype(np.int32)
        t = self.target
        logits, t.kv = t.decode(t.params, t.kv, tokens.astype(np.int32), positions.astype(np.int32), slots, bt, ctx)
        do_sample = bool(np.any(active & (temperature > 0)))
        n = min(MAX_LOGPROBS, self.model_cfg.vocab_size) if num_logprobs > 0 else 0
        out = self._sample(logits, temperature.astype(np.float32), top_k.astype(np.int32), top_p.astype(np.float32),
                           seeds, counters.astype(np.int32), do_sample=do_sample, num_logprobs=n)
        return DecodeResult(*(to_host(x) for x in out))

    @replicated
    def speculate(self, tokens: np.ndarray, positions: np.ndarray, block_tables: list[list[int]], active: np.ndarray,
                  proposals: list[list[int]] | None, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
                  seeds: np.ndarray, counters: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One speculative step: propose k tokens per slot (the draft model on the device, or
        host `proposals`), verify all k+1 positions with the target in one pass. Returns
        (tokens [S, k+1], n_out [S], num_drafts [S]): slot i emits tokens[i, :n_out[i]]."""
        k, s = self.spec_k, len(active)
        bt = self._tables(block_tables, active)
        do_sample = bool(np.any(active & (temperature > 0)))
        args = (temperature.astype(np.float32), top_k.astype(np.int32), top_p.astype(np.float32), seeds,
                counters.astype(np.int32))
        if self.draft is not None:
            d = self.draft
            d.kv, drafts, q = self._propose(d.params, d.kv, tokens.astype(np.int32), positions.astype(np.int32), bt,
                                           active, *args, k=k, page_size=self.cfg.page_size, do_sample=do_sample)
            num_drafts = np.where(active, k, 0).astype(np.int32)
        else:
            drafts = np.zeros((s, k), np.int32)
            num_drafts = np.zeros((s,), np.int32)
            for i, prop in enumerate(proposals or []):
                if active[i] and prop:
                    drafts[i, : len(prop)] = prop[:k]
                    num_drafts[i] = min(len(prop), k)
            q = None
        t = self.target
        t.kv, out, n_out = self._verify(t.params, t.kv, tokens.astype(np.int32), drafts, positions.astype(np.int32), bt,
                                        active, num_drafts, q, *args,
                                        page_size=self.cfg.page_size, do_sample=do_sample)
        return to_host(out), to_host(n_out), num_drafts

    @replicated
    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        for i in range(0, len(pairs), self.copy_batch):
            chunk = pairs[i: i + self.copy_batch]
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
        for b in self.batch_buckets:
            jobs += [("decode", b, (do_sample, nlp)) for do_sample in (False, True) for nlp in (0, 1)]
            if self.spec_k:
                jobs += [("speculate", b, (do_sample, 0)) for do_sample in (False, True)]
        for i, (kind, a, b) in enumerate(jobs):
            if progress:
                progress(f"compiling {kind} {a} {b if b is not None else ''} ({i + 1}/{len(jobs)})")
            if kind == "prefill":
                self.prefill([([0] * a, b, [DUMMY_PAGE] * (self.max_pages_per_seq + a // ps + 2))])
                continue
            z = np.zeros((a,), np.int32)
            active = np.zeros((a,), bool)
            active[0] = True
            tables = [[DUMMY_PAGE] * self.max_pages_per_seq] + [[]] * (a - 1)
            temp = np.full((a,), 1.0 if b[0] else 0.0, np.float32)
            rest = (temp, z, np.ones((a,), np.float32), np.zeros((a, 2), np.uint32), z)
            if kind == "decode":
                self.decode(z, z, tables, active, *rest, b[1])
            else:
                self.speculate(z, z, tables, active, [[0] * self.spec_k] + [[]] * (a - 1), *rest)
        self.copy_pages([(DUMMY_PAGE, DUMMY_PAGE)])
        jax.block_until_ready([w.kv for w in self.models])
        return time.perf_counter() - t0


_KV_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _shape_dict(c: ModelConfig) -> dict:
    return dict(num_hidden_layers=c.num_layers, hidden_size=c.hidden_size, num_attention_heads=c.num_heads,
                num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, intermediate_size=c.intermediate_size,
                vocab_size=c.vocab_size, tie_word_embeddings=c.tie_word_embeddings,
                max_position_embeddings=c.max_position_embeddings)
