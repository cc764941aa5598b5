"""What the runner runs with: the engine's options resolved for this backend and model.

`resolve` turns an `EngineConfig` into a `RunnerConfig`: the dtype, the attention and matmul
kernels (the native C++ ones on the CPU where they are built), the KV pool's size (from the
device memory the weights leave, or on the CPU every slot at full length), the token buckets and
the speculative batch limit. A configuration where one max-length request cannot fit is refused
here, at start, with a ValueError naming the option.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import jax
import jax.numpy as jnp

from jaxserve import kv_math
from jaxserve.models import eagle
from jaxserve.models.model_config import ModelConfig
from jaxserve.runner import attention


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    """What the runner needs of the engine's options, resolved for this backend and model. Built
    only by `resolve` from an EngineConfig, whose declaration holds every option's default and
    help (docs/options.md): the fields here have neither, only what resolving changed."""

    max_slots: int
    page_size: int
    max_model_len: int
    num_pages: int
    # The sliding-window layers' own page pool (the KV manager frees its pages that fell out of
    # the window): its pages, 0 when the model has no sliding layers (or runs a draft model, which
    # shares the target's page ids: then every layer keeps every page), and their window
    local_num_pages: int
    local_window: int | None
    # The ragged step's padded token counts (the last one is the step's token budget,
    # max_num_batched_tokens); a step of T tokens has min(T, max_slots) rows.
    token_buckets: tuple[int, ...]
    dtype: str
    attention_impl: str
    interpret: bool
    kv_cache_dtype: str  # "auto" resolved to bfloat16 where the CPU computes in bfloat16 by default
    matmul_impl: str
    matmul_dtype: str
    matmul_reason: str  # why that matmul_impl / matmul_dtype (the start-up log, model info)
    max_logprobs: int  # the top-n alternatives a decode step computes when any row asks for logprobs
    prompt_logprobs: bool  # warm up the scoring prefill (enable_prompt_logprobs)
    num_speculative_tokens: int  # k of a speculative step; 0 = no speculation
    num_scheduler_steps: int
    # on the CPU CPU_COMPUTE_BOUND_ROWS // (k + 1) by default; None: always speculate
    speculative_disable_by_batch_size: int | None
    tensor_parallel_size: int
    expert_parallel_size: int
    # Speculative batch buckets are powers of two from 8 rows (on TPU/GPU a sublane tile: fewer
    # rows cost the same). On the CPU every padded row costs its share of the matmuls, so a lone
    # request gets a bucket of one row.
    single_row_bucket: bool
    store_context: str | None  # with compilation_cache_dir: the key of the executable store
    compilation_cache_dir: str | None

    @property
    def weight_dtype(self) -> str:
        """What the matmuls read the float weights as: the native kernel's packing, or under
        XLA the model dtype (bfloat16 on a GPU or TPU), for the start-up log and model info."""
        return self.matmul_dtype if self.matmul_impl == "native" else self.dtype


def pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return tuple(out)


def default_attention(backend: str) -> str:
    """Pallas on TPU/GPU; on the CPU the native FFI kernel where it is built, else XLA."""
    if backend != "cpu":
        return "pallas"
    from pallas_kernels import native

    return "native" if native.available() else "xla"


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
    token_buckets = _token_buckets(cfg, backend)
    matmul_impl = _resolve_matmul(cfg, backend)
    matmul_dtype, matmul_reason = _resolve_matmul_dtype(cfg, matmul_impl)
    matmul_reason += _int8_note(cfg, matmul_dtype)
    kv_cache_dtype = cfg.kv_cache_dtype
    if kv_cache_dtype == "auto" and cfg.dtype is None and matmul_dtype == "bfloat16":
        # computing in bfloat16 (AMX / AVX512-BF16) by default: cache in bfloat16 too, as vLLM's CPU
        # backend does (half the bytes every decode step reads); dtype="float32" keeps float32 pages
        kv_cache_dtype = "bfloat16"
    bytes_per_token = kv_bytes_per_token(dtype.name, model_cfg, draft_cfg, kv_cache_dtype=kv_cache_dtype)
    pools = kv_pools(model_cfg, draft_cfg, cfg, max_model_len, token_buckets[-1], bytes_per_token)
    num_pages, local_num_pages = _resolve_pools(cfg, max_model_len, bytes_per_token, weight_bytes, pools)
    spec_k = cfg.num_speculative_tokens if cfg.speculative_model else 0
    return RunnerConfig(
        max_slots=cfg.max_slots,
        page_size=cfg.page_size,
        max_model_len=max_model_len,
        num_pages=num_pages,
        local_num_pages=local_num_pages,
        local_window=pools.window,
        token_buckets=token_buckets,
        dtype=dtype.name,
        attention_impl=_resolve_attention(cfg, backend, kv_cache_dtype),
        interpret=cfg.interpret if cfg.interpret is not None else backend == "cpu",
        kv_cache_dtype=kv_cache_dtype,
        matmul_impl=matmul_impl,
        matmul_dtype=matmul_dtype,
        matmul_reason=matmul_reason,
        max_logprobs=min(max_logprobs, model_cfg.vocab_size),
        prompt_logprobs=cfg.enable_prompt_logprobs,
        num_speculative_tokens=spec_k,
        num_scheduler_steps=cfg.num_scheduler_steps,
        speculative_disable_by_batch_size=_speculative_max_batch(cfg, spec_k, backend),
        tensor_parallel_size=cfg.tensor_parallel_size,
        expert_parallel_size=cfg.expert_parallel_size,
        single_row_bucket=backend == "cpu",
        compilation_cache_dir=cfg.compilation_cache_dir,
        # what the executables were compiled for, as resolved here (packed weights or not)
        store_context=f"{dataclasses.replace(cfg, compilation_cache_dir=None)!r} {model_cfg!r} {draft_cfg!r} "
        f"matmul={matmul_impl}-{matmul_dtype}",
    )


@dataclasses.dataclass(frozen=True)
class KVPools:
    """How the KV cache splits into the full layers' pool and the sliding layers' ("local")
    pool: bytes per token of each, the local pool's pages (0: none) and its window."""

    full_bytes_per_token: int
    local_bytes_per_token: int = 0
    local_pages: int = 0
    window: int | None = None
    page_size: int = 0

    @property
    def local_bytes(self) -> int:
        return self.local_pages * self.page_size * self.local_bytes_per_token

    def saved_bytes(self, num_pages: int) -> int:
        """What the local pool saves over keeping the sliding layers' pages in a full-size pool."""
        return max(0, num_pages - self.local_pages) * self.page_size * self.local_bytes_per_token


def kv_pools(model_cfg: ModelConfig, draft_cfg, cfg, max_model_len: int, budget: int, bytes_per_token: int) -> KVPools:
    """The sliding layers' pool: every slot's window and next tokens, plus one step's prompt
    chunks (`local_pool_pages`). None with a draft model (its pool shares the target's page ids)."""
    window = model_cfg.local_window
    if window is None or draft_cfg is not None:
        return KVPools(bytes_per_token)
    groups = model_cfg.kv_groups()
    local_bpt = bytes_per_token * len(groups["local"]) // model_cfg.num_layers
    ps = cfg.page_size
    ahead = max(cfg.num_speculative_tokens if cfg.speculative_model else 0, cfg.num_scheduler_steps - 1)
    pages = local_pool_pages(window, ps, cfg.max_slots, budget, ahead, -(-max_model_len // ps))
    return KVPools(bytes_per_token - local_bpt, local_bpt, pages, window, ps)


def local_pool_pages(window: int, page_size: int, max_slots: int, budget: int, ahead: int, max_pages: int) -> int:
    """Pages the local pool needs at most (the dummy page included). A request whose next query
    is at s holds the pages of [s - W + 1, s) and those a step writes: a decode's token and its
    lookahead (`ahead`), at most ceil((W + ahead) / page_size) + 2 pages (one more where a range
    straddles a page boundary), never more than its whole context; a prompt chunk of C tokens
    holds ceil(C / page_size) more, and a step's chunks add up to at most its token budget."""
    per_slot = min(max_pages, -(-(window + ahead) // page_size) + 2)
    return max_slots * per_slot + -(-budget // page_size) + 1


def _resolve_pools(cfg, max_model_len: int, bytes_per_token: int, weight_bytes: int, pools: KVPools) -> tuple[int, int]:
    """(full pool pages, local pool pages). The local pool has its worst-case pages
    (`kv_pools`), never more than the pages one pool of every layer would have had in the same
    memory; sized from memory, the full pool then gets what the local pool leaves, at the full
    layers' bytes per token: never fewer pages than before."""
    num_pages = _resolve_num_pages(cfg, max_model_len, bytes_per_token, weight_bytes)
    if not pools.local_pages:
        return num_pages, 0
    local = min(pools.local_pages, num_pages)
    if not cfg.num_pages:
        reserved = local * cfg.page_size * pools.local_bytes_per_token
        num_pages = _resolve_num_pages(cfg, max_model_len, pools.full_bytes_per_token, weight_bytes, reserved)
    return num_pages, local


def _resolve_num_pages(
    cfg, max_model_len: int, bytes_per_token: int, weight_bytes: int, reserved_bytes: int = 0
) -> int:
    """The KV pool's pages: `num_pages` as given, else what the memory left holds (_pool_pages;
    reserved_bytes, the sliding layers' pool, comes off it first). With no full-attention layer
    (every layer slides) the pool's pages hold no bytes: every slot at full length.
    ValueError when one request of max_model_len cannot fit beside the reserved page."""
    ps = cfg.page_size
    max_pages_per_seq = -(-max_model_len // ps)
    if not bytes_per_token:
        return cfg.num_pages or cfg.max_slots * max_pages_per_seq + 1
    num_pages = cfg.num_pages or _pool_pages(cfg, ps * bytes_per_token, max_pages_per_seq, weight_bytes, reserved_bytes)
    if num_pages < max_pages_per_seq + 1:
        raise ValueError(
            f"KV cache too small: one request of max_model_len={max_model_len} needs "
            f"{max_pages_per_seq} pages of {ps} tokens ({max_pages_per_seq * ps * bytes_per_token / 2**20:.1f} MiB "
            f"at {bytes_per_token} bytes/token) plus the reserved page, but the pool has {num_pages} "
            f"pages; raise num_pages / kv_cache_memory_bytes or lower max_model_len"
        )
    return num_pages


def _resolve_attention(cfg, backend: str, kv_cache_dtype: str) -> str:
    """The attention backend: `attention_impl` as given (ValueError where it cannot run), else
    default_attention's, falling back to XLA for fp8 pages the native kernel cannot read."""
    if cfg.attention_impl == "native":
        from pallas_kernels import native

        if backend != "cpu" or not native.available():
            why = "it runs on the CPU only" if backend != "cpu" else native.unavailable_reason()
            raise ValueError(f"attention_impl='native' is unavailable here: {why}")
    if cfg.attention_impl in attention.PROMPT_IMPLS and backend == "tpu":
        raise ValueError(f"attention_impl={cfg.attention_impl!r} needs a GPU (the CPU runs it with XLA standing in)")
    if cfg.attention_impl == "tokamax" and importlib.util.find_spec("tokamax") is None:
        raise ValueError("attention_impl='tokamax' needs the tokamax package (pip install tokamax)")
    attention_impl = cfg.attention_impl or default_attention(backend)
    if kv_cache_dtype == "fp8" and attention_impl == "native":
        if cfg.attention_impl == "native":
            raise ValueError(
                "kv_cache_dtype='fp8' is not supported by attention_impl='native' (the CPU kernel reads "
                "int8 pages); use kv_cache_dtype='int8' or attention_impl='xla'"
            )
        attention_impl = "xla"  # the CPU default falls back to the XLA path, which reads fp8 pages
    return attention_impl


def _speculative_max_batch(cfg, spec_k: int, backend: str) -> int | None:
    """speculative_disable_by_batch_size as given, else on the CPU (without adaptive prompt
    lookup, which decides by measured costs) CPU_COMPUTE_BOUND_ROWS // (k + 1)."""
    spec_max_batch = cfg.speculative_disable_by_batch_size
    adaptive = cfg.speculative_model == "ngram" and cfg.speculative_adaptive
    if spec_max_batch is None and spec_k and backend == "cpu" and not adaptive:  # compute-bound from ~16 rows
        spec_max_batch = max(1, CPU_COMPUTE_BOUND_ROWS // (spec_k + 1))
    return spec_max_batch


# The step's token budget by backend when max_num_batched_tokens is not given. On the CPU a step
# is compute-bound past a few dozen tokens, so its time grows with every prompt token it
# carries: 256 keeps the decode rows riding with a prompt chunk within a few decode steps'
# time, and a long prompt's first token within a few hundred ms (docs/benchmarks.md).
DEFAULT_TOKEN_BUDGET = {"cpu": 256}
# Rows from which a CPU decode step is compute-bound rather than memory-bound (kv-math's
# crossover on the 2-core development hosts: docs/architecture.md). A speculative step verifying
# more rows than this costs about what its rows cost, so it no longer pays: n-gram at batch 8,
# k = 3 (32 rows) ran 0.76x plain on SmolLM2 (docs/benchmarks-log.md, 2026-12-04).
CPU_COMPUTE_BOUND_ROWS = 16


def _token_buckets(cfg, backend: str) -> tuple[int, ...]:
    """The ragged step's token buckets: `token_buckets` as given, else powers of two from 16 to
    the budget (`max_num_batched_tokens`), on the CPU with 1 and 8 below them and 1.5x each
    power from 256 (384, 768, ...) between them (padded tokens cost real work there: 16 decode
    rows beside a 256-token chunk padded to 512 cost 1.33x the chunk, to 384 1.12x; and a lone
    decode is the latency case). The budget must hold a
    decode row of every slot; ValueError naming the field otherwise."""
    if cfg.token_buckets:
        buckets = tuple(cfg.token_buckets)
        if cfg.max_num_batched_tokens is not None and cfg.max_num_batched_tokens != buckets[-1]:
            raise ValueError(
                f"max_num_batched_tokens ({cfg.max_num_batched_tokens}) must equal the largest of token_buckets "
                f"{buckets}"
            )
        name = "token_buckets"
    else:
        budget = cfg.max_num_batched_tokens or DEFAULT_TOKEN_BUDGET.get(backend, 512)
        buckets = pow2_buckets(16, max(16, budget))
        if backend == "cpu":  # padded tokens still cost XLA's elementwise work: past 256, midpoints
            mids = [b * 3 // 2 for b in buckets if 256 <= b and b * 3 // 2 < buckets[-1]]
            buckets = tuple(sorted({1, 8, *buckets, *mids}))
        name = "max_num_batched_tokens"
    if buckets[-1] < cfg.max_slots:
        raise ValueError(
            f"{name}: a step of {buckets[-1]} tokens cannot hold a decode row of each of {cfg.max_slots} slots"
        )
    return buckets


def _resolve_matmul(cfg, backend: str) -> str:
    """The native matmul on the CPU where it is built and the model is not split across chips
    (XLA's partitioner cannot split a custom call); XLA's dot otherwise."""
    from pallas_kernels import native_matmul

    if cfg.matmul_impl == "native":
        if backend != "cpu" or not native_matmul.available():
            why = "it runs on the CPU only" if backend != "cpu" else native_matmul.unavailable_reason()
            raise ValueError(f"matmul_impl='native' is unavailable here: {why}")
        if cfg.tensor_parallel_size > 1 or cfg.expert_parallel_size > 1:
            raise ValueError(
                "matmul_impl='native' cannot be split across chips; use tensor_parallel_size=1 and "
                "expert_parallel_size=1, or 'xla'"
            )
        return "native"
    one_chip = cfg.tensor_parallel_size == 1 and cfg.expert_parallel_size == 1
    if cfg.matmul_impl is None and backend == "cpu" and one_chip and native_matmul.available():
        return "native"
    return "xla"


def _bf16_unit() -> str:
    from pallas_kernels import native

    return {
        "amx": "AMX bf16 tiles",
        "avx512bf16": "AVX512-BF16 dot products",
    }.get(native.cpu_isa(), f"{native.cpu_isa().upper()}: bfloat16 weights widened to float32, float32 arithmetic")


def _resolve_matmul_dtype(cfg, matmul_impl: str) -> tuple[str, str]:
    """The native matmul's float weights and why: bfloat16 (AMX tiles or AVX512-BF16 dot products)
    by default where the CPU has them and the user left ``dtype`` unset (an explicit dtype="float32" keeps today's
    exact path); float32 otherwise. An explicit matmul_dtype="bfloat16" runs on any AVX2 host (half the
    weight bytes; float32 arithmetic without the bfloat16 units) and is refused where the kernel cannot
    run (ValueError naming the field)."""
    from pallas_kernels import native_matmul

    if matmul_impl != "native":
        if cfg.matmul_dtype == "bfloat16":
            raise ValueError("matmul_dtype='bfloat16' needs the native CPU matmul (matmul_impl='native')")
        return "float32", f"matmul_impl={matmul_impl}"
    if cfg.matmul_dtype == "bfloat16":
        why_not = native_matmul.bf16_unavailable_reason()
        if why_not:
            raise ValueError(f"matmul_dtype='bfloat16' is unavailable here: {why_not}")
        return "bfloat16", f"matmul_dtype='bfloat16' ({_bf16_unit()})"
    if cfg.matmul_dtype == "float32":
        return "float32", "matmul_dtype='float32'"
    if cfg.dtype is not None:
        return "float32", f"dtype={cfg.dtype!r} given (matmul_dtype='bfloat16' for the CPU's bfloat16 units)"
    why_not = native_matmul.bf16_units_missing_reason()
    if why_not:
        hint = "; matmul_dtype='bfloat16' halves the weights' bytes" if native_matmul.bf16_available() else ""
        return "float32", why_not + hint
    return "bfloat16", f"default on a CPU with {_bf16_unit()} (matmul_dtype='float32' for the exact float32 path)"


def _int8_note(cfg, matmul_dtype: str) -> str:
    """What int8 weights under a bfloat16 matmul compute in (the start-up log's reason)."""
    if cfg.quantization != "int8" or matmul_dtype != "bfloat16":
        return ""
    from pallas_kernels import native_matmul

    return (
        "; int8 weights widened to bfloat16 in the kernel (W8A16)"
        if native_matmul.bf16_units()
        else "; int8 weights in float32 arithmetic (no bfloat16 units)"
    )


def kv_bytes_per_token(dtype: str, *cfgs: ModelConfig | None, kv_cache_dtype: str = "auto") -> int:
    """KV bytes one token takes in the pool, the target's and a draft's together; an 8-bit
    cache ("int8" / "fp8") counts its bfloat16 per-token-per-head scales too."""
    kv = _KV_DTYPE[dtype] if kv_cache_dtype == "auto" else _KV_DTYPE.get(kv_cache_dtype, kv_cache_dtype)
    total = sum(kv_math.kv_bytes_per_token(c.shape(), kv_dtype=kv) for c in cfgs if c is not None)
    # an EAGLE head's pool also holds the target's feature at every token, in the model's dtype
    return total + sum(
        c.hidden_size * jnp.dtype(dtype).itemsize for c in cfgs if c and c.architecture == eagle.ARCHITECTURE
    )


def _pool_pages(cfg, bytes_per_page: int, max_pages_per_seq: int, weight_bytes: int, reserved: int = 0) -> int:
    budget = cfg.kv_cache_memory_bytes
    if budget is None:
        stats = jax.local_devices()[0].memory_stats() or {}  # every process: its own chips
        if "bytes_limit" in stats:
            budget = int(stats["bytes_limit"] * cfg.memory_fraction) - weight_bytes - stats.get("bytes_in_use", 0)
        else:  # CPU: enough for every slot at full length, at most 2 GiB (the local pool's included)
            return max(0, min((2 << 30) - reserved, (cfg.max_slots * max_pages_per_seq + 1) * bytes_per_page)) // (
                bytes_per_page
            )
    return max(0, (budget - reserved) // bytes_per_page)


_KV_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
