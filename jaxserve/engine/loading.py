"""Building an engine: the model's weights, its tokenizer and a speculative draft loaded, the KV
pool sized to the memory left, the runner, KV manager, scheduler and grammars made, and every step
compiled before the first request (vLLM v1 loads in its worker and hands the engine core built
parts; so does this).

`load_engine` is how `LLM` and the servers get an `EngineCore`; the core itself only steps what
it is given, so a test or a tool can hand it other parts.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path

from jaxserve.engine import allocator as allocator_mod
from jaxserve.engine import request as request_mod
from jaxserve.engine.allocator import PageAllocator
from jaxserve.engine.core import EngineCore
from jaxserve.engine.engine_config import EngineConfig
from jaxserve.engine.kv_manager import KVManager
from jaxserve.engine.radix_cache import RadixCache
from jaxserve.engine.request import MAX_LOGPROBS
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.speculation import Speculation
from jaxserve.engine.tokenizer import load_tokenizer
from jaxserve.models import registry

log = logging.getLogger("jaxserve.engine")


def load_engine(
    model: str | Path | None = None, *, warmup: bool = True, log_progress: bool = False, **engine_options
) -> EngineCore:
    """A ready engine for `model` (a checkpoint directory or GGUF file; default: the default
    model) with `engine_options` (EngineConfig's fields): loaded, sized and, with `warmup`,
    compiled for every shape serving runs (`log_progress`: each compile on stderr). On a follower
    process of several it replays the leader's runner calls and returns when the leader shuts
    down. ValueError naming the option when a configuration cannot run."""
    from jaxserve.runner import step_batch

    assert step_batch.DUMMY_PAGE == allocator_mod.DUMMY_PAGE, "allocator and runner disagree on the dummy page"
    for name in ("PENALTY_TOKENS", "MAX_LOGIT_BIAS", "MAX_STOP_IDS"):
        assert getattr(step_batch, name) == getattr(request_mod, name), f"request and runner disagree on {name}"
    path = registry.model_path(model)
    cfg = EngineConfig(**engine_options)
    runner, model_cfg, tokenizer = _load_runner(path, cfg)
    eos = eos_ids(model_cfg, tokenizer)
    allocator = PageAllocator(runner.cfg.num_pages, cfg.page_size)
    rc = runner.cfg
    # the sliding layers' pool: pages that fall out of their window are freed (kv_manager)
    local = PageAllocator(rc.local_num_pages, cfg.page_size) if rc.local_num_pages else None
    window = rc.local_window if local is not None else None
    cache = RadixCache(allocator, local, window) if cfg.enable_prefix_caching else None
    kv = KVManager(allocator, cache, local=local, window=window)
    scheduler = Scheduler(
        kv,
        cfg.max_slots,
        runner.max_model_len,
        max_num_batched_tokens=runner.token_buckets[-1],
        eos_token_ids=eos,
        lookahead=runner.spec_k,
        max_prefill_tokens_while_decoding=cfg.max_prefill_tokens_while_decoding,
        token_buckets=runner.token_buckets,
    )
    speculation = _speculation(runner, cfg, scheduler.eos) if runner.spec_k else None
    from jaxserve.engine.structured import Grammars

    grammars = Grammars(tokenizer, model_cfg.vocab_size, eos)
    if runner.is_follower:
        # Another host's process: replay the leader's runner calls (its warm-up included)
        # until it shuts down. The scheduler and the frontends run on process 0 only.
        runner.follow_leader()
    elif warmup:
        _warm_up(runner, speculation, log_progress)
    return EngineCore(
        cfg=cfg,
        model_path=path,
        model_cfg=model_cfg,
        tokenizer=tokenizer,
        runner=runner,
        kv=kv,
        scheduler=scheduler,
        grammars=grammars,
        speculation=speculation,
    )


def eos_ids(model_cfg, tokenizer) -> tuple[int, ...]:
    """The ids that end a request: the checkpoint's EOS ids and its tokenizer's."""
    ids = set(model_cfg.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def _load_runner(path: Path, cfg: EngineConfig):
    """(the model runner, the model's config, its tokenizer or None): the weights and a draft
    loaded, the engine's options resolved for this backend (the KV pool sized from the memory
    the weights leave) and the runner built on them."""
    import jax
    from flax import nnx

    from jaxserve.models.loader import load_model
    from jaxserve.runner import model_runner, runner_config

    module, model_cfg = load_model(path, dtype=cfg.dtype, quantization=cfg.quantization)
    tokenizer = load_tokenizer(path)
    draft, draft_cfg = load_draft(cfg, module, model_cfg)
    # by identity: an EAGLE head's embedding is the target's array
    arrays = {id(x): x for m in (module, draft) if m is not None for x in jax.tree.leaves(nnx.state(m))}
    weight_bytes = sum(x.size * x.dtype.itemsize for x in arrays.values())
    rc = runner_config.resolve(model_cfg, draft_cfg, cfg, weight_bytes, MAX_LOGPROBS)
    runner = model_runner.ModelRunner(module, model_cfg, rc, draft, draft_cfg)
    bytes_per_token = runner_config.kv_bytes_per_token(rc.dtype, model_cfg, draft_cfg, kv_cache_dtype=rc.kv_cache_dtype)
    pools = runner_config.kv_pools(model_cfg, draft_cfg, cfg, rc.max_model_len, rc.token_buckets[-1], bytes_per_token)
    if rc.local_num_pages:
        pools = dataclasses.replace(pools, local_pages=rc.local_num_pages)
        log.info(
            "KV cache: sliding-window layers (window %d) in their own pool of %d pages (%.1f MiB): pages out of "
            "the window are freed, %.1f MiB saved against every layer keeping every page",
            rc.local_window,
            rc.local_num_pages,
            pools.local_bytes / 2**20,
            pools.saved_bytes(rc.num_pages) / 2**20,
        )
    log.info(
        "KV cache: %d pages x %d tokens (%.1f MiB, %s), %d slots, max_model_len %d, attention %s",
        rc.num_pages,
        rc.page_size,
        rc.num_pages * rc.page_size * pools.full_bytes_per_token / 2**20,
        rc.dtype if rc.kv_cache_dtype == "auto" else rc.kv_cache_dtype,
        rc.max_slots,
        rc.max_model_len,
        rc.attention_impl,
    )
    log.info("matmul: %s, %s weights (%s)", rc.matmul_impl, rc.weight_dtype, rc.matmul_reason)
    return runner, model_cfg, tokenizer


def load_draft(cfg: EngineConfig, target, model_cfg):
    """(draft module, its config) for `speculative_model`, or (None, None): a draft
    checkpoint, or an EAGLE head, which shares `target`'s embedding."""
    spec = cfg.speculative_model
    if spec is None or spec == "ngram":
        return None, None
    from jaxserve.models import eagle
    from jaxserve.models.loader import load_model

    if spec == "default":
        raise ValueError(
            "speculative_model: no draft model ships with the default model (an EAGLE head trained on this "
            "project's 2-core machine made batch-1 decoding slower: docs/default-model.md); use 'ngram' "
            "(prompt lookup), an EAGLE head (scripts/train_eagle.py) or a draft checkpoint that shares "
            "the target's tokenizer"
        )
    if eagle.is_eagle_dir(spec):
        import jax.numpy as jnp

        dtype = jnp.dtype(cfg.dtype) if cfg.dtype else target.input_embedding().dtype
        return eagle.load_head(spec, target, model_cfg, dtype)
    draft, dcfg = load_model(spec, dtype=cfg.dtype, quantization=cfg.quantization)
    if dcfg.vocab_size != model_cfg.vocab_size:
        raise ValueError(
            f"speculative_model: the draft's vocabulary ({dcfg.vocab_size}) differs from the "
            f"target's ({model_cfg.vocab_size})"
        )
    return draft, dcfg


def _speculation(runner, cfg: EngineConfig, eos: frozenset[int]) -> Speculation:
    """The host side of a speculative engine: its name and, under adaptive prompt lookup, the
    policy that decides which drafts pay."""
    name = "ngram" if runner.draft is None else "eagle" if runner.eagle else Path(cfg.speculative_model).name
    policy = None
    if name == "ngram" and cfg.speculative_adaptive:
        from jaxserve.engine.spec_policy import SpecPolicy

        policy = SpecPolicy(runner.spec_k, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
    return Speculation(runner, cfg, eos, name, policy)


def _warm_up(runner, speculation: Speculation | None, log_progress: bool) -> None:
    """Compile every step serving runs (and, under adaptive prompt lookup, measure the verify
    step's cost on this host from real steps)."""
    say = (lambda m: print(f"[jaxserve] {m}", file=sys.stderr, flush=True)) if log_progress else None
    secs = runner.warmup(say)
    if speculation is not None and speculation.policy is not None:
        from jaxserve.engine.spec_policy import StepCosts

        speculation.policy.costs = StepCosts(runner.time_steps())
    store = runner.store
    log.info(
        "warm-up compiled every bucket in %.1fs%s",
        secs,
        f" ({store.loaded} executables loaded from {store.dir}, {store.saved} compiled and saved)"
        if store is not None
        else "",
    )
