"""Held-out loss of a model with its KV cache in float32, int8 and fp8 (kv_cache_dtype).

The split and the windows are those of scripts/train_default_model.py (files whose
sha256(path) % 50 == 0 held out, non-overlapping windows of 256 predicted tokens, the shipped
tokenizer). Each window runs as one sequence through the paged serving path: its K/V are
written into the page pool with ``reference.write_kv`` (quantized for int8 / fp8) and every
query reads them back from the pages ("context" mode, the loop decode uses), so each
prediction sees exactly the keys and values an 8-bit cache would hold.

    python scripts/eval_kv_quant.py                 # the shipped default target
    python scripts/eval_kv_quant.py --json out.json --kinds auto int8 fp8
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "scripts"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxserve.models.loader import load_model  # noqa: E402
from jaxserve.runner import attention  # noqa: E402
from pallas_kernels import reference  # noqa: E402


def heldout_windows(model_dir: Path, seq_len: int = 256, modulus: int = 50) -> np.ndarray:
    """[n, seq_len + 1] held-out windows exactly as train_default_model.py builds them."""
    from tokenizers import Tokenizer
    from train_default_model import collect_files, eval_windows, is_heldout, token_stream

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    files = collect_files(Path(sysconfig.get_paths()["stdlib"]))
    held = [t for r, t in files if is_heldout(r, modulus)]
    return eval_windows(token_stream(tok, held), seq_len)


def paged_losses(model, cfg, windows: np.ndarray, kv_cache_dtype: str, batch: int = 8, page_size: int = 16):
    """(per-token losses [n, seq_len], greedy predictions [n, seq_len]) with every window's
    K/V written into a page pool of kv_cache_dtype and read back through the block tables."""
    n, t1 = windows.shape
    t = t1 - 1
    pages_per_row = -(-t // page_size)
    num_pages = 1 + batch * pages_per_row
    graphdef, params = nnx.split(model)
    attn = attention.make("xla").forward

    @jax.jit
    def run(params, toks):
        m = nnx.merge(graphdef, params)
        x, y = toks[:, :-1], toks[:, 1:]
        kv = tuple(
            reference.empty_kv_cache(num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, jnp.float32, kv_cache_dtype)
            for _ in range(cfg.num_layers)
        )
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], x.shape)
        tables = 1 + jnp.arange(batch, dtype=jnp.int32)[:, None] * pages_per_row + jnp.arange(pages_per_row)[None]
        tables = jnp.pad(tables, ((0, 0), (0, pages_per_row % 2)))
        slots = jnp.take_along_axis(tables, pos // page_size, axis=1) * page_size + pos % page_size
        qsl = jnp.arange(batch + 1, dtype=jnp.int32) * t  # one ragged step of `batch` rows of t tokens
        meta = reference.RaggedMetadata(
            slots.reshape(-1), tables, jnp.full((batch,), t, jnp.int32), qsl, pos.reshape(-1)
        )
        logits, _ = m(x, pos, kv, meta, attn)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.take_along_axis(logp, y[..., None], axis=-1)[..., 0], jnp.argmax(logits, axis=-1)

    losses, preds = [], []
    for i in range(0, n, batch):
        chunk = windows[i : i + batch]
        pad = batch - len(chunk)
        if pad:
            chunk = np.concatenate([chunk, np.zeros((pad, t1), chunk.dtype)])
        l, p = run(params, jnp.asarray(chunk))
        losses.append(np.asarray(l)[: batch - pad])
        preds.append(np.asarray(p)[: batch - pad])
    return np.concatenate(losses), np.concatenate(preds)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "assets" / "models" / "default" / "target")
    ap.add_argument("--kinds", nargs="+", default=["auto", "int8", "fp8"], choices=reference.KV_CACHE_DTYPES)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--heldout-modulus", type=int, default=50)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    t0 = time.time()
    windows = heldout_windows(args.model, args.seq_len, args.heldout_modulus)
    model, cfg = load_model(args.model, dtype=jnp.float32)
    print(f"{args.model}: {len(windows)} held-out windows, {windows[:, 1:].size:,} predictions")
    rows, base = {}, None
    for kind in args.kinds:
        losses, preds = paged_losses(model, cfg, windows, kind)
        row = {"loss": float(losses.mean()), "perplexity": float(np.exp(losses.mean()))}
        if base is None:
            base = (row["loss"], preds)
        row["loss_vs_first"] = row["loss"] / base[0] - 1.0
        row["greedy_agreement_with_first"] = float((preds == base[1]).mean())
        rows[kind] = row
        print(
            f"kv_cache_dtype={kind:5s} loss {row['loss']:.5f} nats/token  ({row['loss_vs_first']:+.3%} vs "
            f"{args.kinds[0]}), next-token argmax agrees with {args.kinds[0]} at "
            f"{row['greedy_agreement_with_first']:.2%} of positions"
        )
    out = {"model": str(args.model), "windows": int(len(windows)), "seconds": time.time() - t0, "results": rows}
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
