"""Accuracy of quantization on the shipped default model: held-out loss and greedy agreement.

For each combination of weights {fp32, int8, bf16, int8-bf16} and KV cache {auto, int8} (the int8
KV cache where this checkout's EngineConfig has ``kv_cache_dtype``; bf16: the native matmul's
bfloat16 AMX tiles or AVX512-BF16 dot products, ``matmul_dtype="bfloat16"``, on a CPU that has
them, else bfloat16 weights widened to float32 on AVX2; int8: int8 weights with float32
arithmetic; int8-bf16: int8 weights widened to bfloat16 on those units, W8A16, the engine's
default for ``quantization="int8"`` on such a CPU):

- held-out loss: mean next-token cross-entropy (nats) over the training script's held-out split
  (Python stdlib files with sha256(path) % 50 == 0, tokenized with the shipped tokenizer, windows
  of 256 tokens, as scripts/train_default_model.py evaluates), computed through the paged KV
  path: every window's keys and values are written into a page pool of the configuration's
  dtype and attention reads them as the pool holds them (``reference.write_kv``), so an 8-bit
  cache's rounding is in the loss;
- greedy agreement with fp32: 64 held-out prompts (32 tokens each), 128 greedy tokens each,
  through the engine (``LLM``): identical completions, tokens equal to fp32's, and the mean
  position of the first difference.

    JAX_PLATFORMS=cpu .venv/bin/python scripts/eval_quant.py [--weights fp32,int8,bf16,int8-bf16] [--kv auto,int8]
        [--prompts 64] [--tokens 128] [--keep-full-precision lm_head] [--json F]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))


def kv_option_exists() -> bool:
    from jaxserve.engine.engine_config import EngineConfig

    return "kv_cache_dtype" in {f.name for f in dataclasses.fields(EngineConfig)}


def heldout_windows(model_dir: Path, seq_len: int, modulus: int):
    from tokenizers import Tokenizer
    from train_default_model import collect_files, eval_windows, is_heldout, token_stream

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    held = [t for r, t in collect_files(stdlib) if is_heldout(r, modulus)]
    if model_dir.suffix == ".gguf":  # its own vocabulary: documents between its BOS and EOS tokens
        import numpy as np

        from jaxserve.engine.tokenizer import load_tokenizer

        tok = load_tokenizer(model_dir)
        enc = tok.backend_tokenizer.encode_batch(held, add_special_tokens=False)
        bos, eos = tok.bos_token_id, tok.eos_token_id
        return eval_windows(np.concatenate([np.asarray([bos] + e.ids + [eos], np.int32) for e in enc]), seq_len)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return eval_windows(token_stream(tok, held), seq_len)


def heldout_loss(model, cfg, windows, kv: str, batch: int = 16, page_size: int = 16, attention: str = "xla") -> float:
    """Mean next-token cross-entropy over every target of the windows, through the page pool and
    the `attention` backend (native: the engine's CPU kernel, whose bfloat16 dot-product variant
    reads a bfloat16 pool on a CPU with AVX512-BF16)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from pallas_kernels import reference

    t = windows.shape[1] - 1
    pages_per_row = -(-t // page_size)
    num_pages = batch * pages_per_row + 1
    rows = np.arange(batch)[:, None]
    block_tables = 1 + rows * pages_per_row + np.arange(pages_per_row)[None]
    slots = block_tables[:, np.arange(t) // page_size] * page_size + np.arange(t) % page_size
    positions = np.broadcast_to(np.arange(t), (batch, t))
    # one ragged step of `batch` rows of t tokens each
    meta = reference.RaggedMetadata(
        slot_mapping=jnp.asarray(slots.reshape(-1), jnp.int32),
        block_tables=jnp.asarray(block_tables, jnp.int32),
        seq_lens=jnp.full((batch,), t, jnp.int32),
        query_start_loc=jnp.arange(batch + 1, dtype=jnp.int32) * t,
        positions=jnp.asarray(positions.reshape(-1), jnp.int32),
    )
    empty = getattr(reference, "empty_kv_cache", None)

    def make_cache():
        if empty is not None:
            extra = {} if kv == "auto" else {"kv_cache_dtype": kv}
            return tuple(
                empty(num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, jnp.float32, **extra)
                for _ in range(cfg.num_layers)
            )
        if kv != "auto":
            raise SystemExit("this checkout has no quantized KV cache")
        z = jnp.zeros((num_pages, page_size, cfg.num_kv_heads, cfg.head_dim), jnp.float32)
        return tuple((z, z) for _ in range(cfg.num_layers))

    graphdef, state = nnx.split(model)
    from jaxserve.runner.attention import make as attention_backend

    attn = attention_backend(attention).forward

    @jax.jit
    def losses(state, toks, weights):
        m = nnx.merge(graphdef, state)
        logits, _ = m(toks[:, :-1], meta.positions.reshape(batch, t), make_cache(), meta, attn)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, toks[:, 1:])
        return (ce.sum(axis=1) * weights).sum()

    total = 0.0
    for i in range(0, len(windows), batch):
        chunk = windows[i : i + batch]
        w = np.zeros(batch, np.float32)
        w[: len(chunk)] = 1.0
        if len(chunk) < batch:
            chunk = np.concatenate([chunk, np.zeros((batch - len(chunk), chunk.shape[1]), chunk.dtype)])
        total += float(losses(state, jnp.asarray(chunk, jnp.int32), jnp.asarray(w)))
    return total / (len(windows) * t)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the shipped target)")
    ap.add_argument("--weights", default="fp32,int8")
    ap.add_argument("--kv", default="auto,int8", help="KV pool dtypes: auto, int8, bfloat16, fp8")
    ap.add_argument(
        "--attention", default=None, help="native | xla: the held-out loss's attention (default: native where built)"
    )
    ap.add_argument("--keep-full-precision", default="", help="comma-separated projections kept in fp32, e.g. lm_head")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--heldout-modulus", type=int, default=50)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args(argv)

    import jax.numpy as jnp
    import numpy as np

    from jaxserve import LLM, SamplingParams
    from jaxserve.models.loader import load_model

    model_dir = Path(args.model) if args.model else REPO / "assets" / "models" / "default" / "target"
    keep = tuple(x for x in args.keep_full_precision.split(",") if x)
    kvs = [k for k in args.kv.split(",") if k]
    if not kv_option_exists():
        print(f"EngineConfig has no kv_cache_dtype yet: KV {[k for k in kvs if k != 'auto']} skipped", flush=True)
        kvs = [k for k in kvs if k == "auto"]
    combos = [(w, k) for k in kvs for w in args.weights.split(",") if w]
    windows = heldout_windows(model_dir, args.seq_len, args.heldout_modulus)
    rng = np.random.default_rng(0)
    picks = rng.choice(len(windows), size=min(args.prompts, len(windows)), replace=False)
    prompts = [[0] + [int(x) for x in windows[i, : args.prompt_len - 1]] for i in sorted(picks)]  # <s> first
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    results = {
        "model": str(model_dir),
        "heldout_tokens": int(windows.shape[0] * (windows.shape[1] - 1)),
        "keep_full_precision": list(keep),
        "combos": {},
    }
    print(
        f"held-out: {len(windows)} windows of {args.seq_len}; {len(prompts)} prompts x {args.tokens} tokens", flush=True
    )
    from pallas_kernels import native

    attention = args.attention or ("native" if native.available() else "xla")
    print(f"attention {attention}, CPU instruction set {native.cpu_isa()}", flush=True)
    ref_loss, ref_out = None, None
    for w, k in combos:
        t0 = time.perf_counter()
        quant = "int8" if w.startswith("int8") else None
        on_bf16 = w in ("bf16", "int8-bf16")
        model, cfg = load_model(
            model_dir, dtype=jnp.float32, quantization=quant, keep_full_precision=keep if quant else ()
        )
        if on_bf16:  # every projection and the LM head on the bfloat16 units, as the engine packs them
            from jaxserve.models.linear import pack_native

            pack_native(model, "bfloat16")
        loss = heldout_loss(model, cfg, windows, k, attention=attention)
        name = f"weights={w} kv={k}"
        row = {"heldout_loss": loss}
        if ref_loss is None:
            ref_loss = loss
        row["loss_vs_fp32"] = loss / ref_loss - 1
        if keep and quant:  # the engine has no such option: greedy agreement is for the default only
            row["greedy"] = "not measured (keep_full_precision is a load_model option, not an engine one)"
        else:
            opts = {"quantization": quant, "matmul_dtype": "bfloat16" if on_bf16 else None}
            if k != "auto":
                opts["kv_cache_dtype"] = k
            llm = LLM(model_dir, dtype="float32", max_slots=16, max_model_len=256, **opts)
            outs = [o.token_ids for o in llm.generate(prompts, [params] * len(prompts))]
            row["compiles_after_warmup"] = llm.compiles_since_warmup()
            del llm
            if ref_out is None:
                ref_out = outs
            same = sum(a == b for a, b in zip(outs, ref_out))
            equal_tokens = sum(x == y for a, b in zip(outs, ref_out) for x, y in zip(a, b))
            first_diff = [
                next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(outs, ref_out)
            ]
            row.update(
                identical_completions=f"{same}/{len(prompts)}",
                token_agreement=equal_tokens / (len(prompts) * args.tokens),
                mean_first_difference=float(np.mean(first_diff)),
            )
        row["seconds"] = time.perf_counter() - t0
        results["combos"][name] = row
        greedy = (
            f"greedy vs fp32: {row['identical_completions']} identical, {row['token_agreement']:.1%} of tokens "
            f"equal, first difference at token {row['mean_first_difference']:.1f} on average; compiles after "
            f"warm-up {row['compiles_after_warmup']}"
            if "identical_completions" in row
            else row["greedy"]
        )
        print(f"{name:24s} held-out loss {loss:.5f} ({row['loss_vs_fp32']:+.4%} vs fp32); {greedy}", flush=True)
        del model
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
