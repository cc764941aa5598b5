#!/usr/bin/env python
"""Train and export jaxserve's default model pair: a ~6.5M-parameter Llama target and a
~0.9M-parameter draft for speculative decoding, both on the Python standard library's source.

Everything is seeded and runs for a fixed number of steps, so that a rerun on the same
Python (3.11 stdlib) and the same jax/tokenizers versions reproduces the shipped weights:

    .venv/bin/python scripts/train_default_model.py            # full run, ~25 min on 2 CPU cores
    .venv/bin/python scripts/train_default_model.py --smoke --out /tmp/smoke --plot /tmp/smoke/loss.png  # ~1 min check

Steps: collect the stdlib's .py files (sorted; a fixed ~2% of files, chosen by a hash of the
relative path, held out), train a byte-level BPE tokenizer on the training files, train the
target and the draft (AdamW, warmup + cosine, next-token cross-entropy), evaluate both and a
unigram baseline on the held-out files, plot the loss curves, print greedy completions, export
both as Hugging Face checkpoints and check that jaxserve and transformers agree on them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxserve.models.export import save_hf_checkpoint  # noqa: E402
from jaxserve.models.llama import LlamaForCausalLM  # noqa: E402
from jaxserve.models.model_config import ModelConfig  # noqa: E402
from jaxserve.tools.bench.quality import is_heldout  # noqa: E402
from jaxserve.tools.bench.quality import stdlib_files as collect_files  # noqa: E402

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
SPECIALS = [BOS, EOS, PAD]  # ids 0, 1, 2
PROMPTS = [
    "def fibonacci(n):",
    "import os\n\n\ndef list_python_files(path):",
    "class Stack:\n    def __init__(self):",
    "    def __repr__(self):",
    "for i in range(10):",
]


def log(msg: str) -> None:
    print(msg, flush=True)


# ----------------------------------------------------------------------------- data


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer, length=len(texts))
    for i, s in enumerate(SPECIALS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    # Prompts get <s> in front, as every document does in training.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)]
    )
    return tok


def token_stream(tok, texts: list[str]) -> np.ndarray:
    """<s> doc </s> <s> doc </s> ... as one int32 array."""
    enc = tok.encode_batch(texts, add_special_tokens=False)
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    return np.concatenate([np.asarray([bos] + e.ids + [eos], np.int32) for e in enc])


def eval_windows(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """Non-overlapping [n, seq_len+1] windows with stride seq_len: every token after the first
    of the (truncated) stream is predicted exactly once."""
    n = (len(stream) - 1) // seq_len
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None]
    return stream[idx]


# ----------------------------------------------------------------------------- models


def make_config(
    name: str, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, inter: int, tie: bool, max_pos: int
) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hidden // heads,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=max_pos,
        tie_word_embeddings=tie,
        eos_token_ids=(SPECIALS.index(EOS),),
        bos_token_id=SPECIALS.index(BOS),
        name=name,
    )


def count_params(model) -> int:
    _, state = nnx.split(model, nnx.Param)
    return int(sum(np.prod(v.shape) for v in jax.tree.leaves(state)))


class Trainer:
    """Functional training over nnx.split state: jit(value_and_grad(loss)) + optax AdamW."""

    def __init__(
        self,
        cfg: ModelConfig,
        seed: int,
        lr: float,
        warmup: int,
        steps: int,
        weight_decay: float,
        residual_scale: bool = True,
    ):
        model = LlamaForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed))
        if residual_scale:  # GPT-2: residual-branch outputs start at std 0.02 / sqrt(2 * layers)
            for layer in model.layers:
                for lin in (layer.self_attn.o_proj, layer.mlp.down_proj):
                    lin.kernel[...] = lin.kernel[...] / math.sqrt(2 * cfg.num_layers)
        self.cfg = cfg
        self.graphdef, self.params = nnx.split(model, nnx.Param)
        self.schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, steps, end_value=lr * 0.1)
        self.tx = optax.chain(
            optax.clip_by_global_norm(1.0),
            optax.adamw(
                self.schedule,
                b1=0.9,
                b2=0.95,
                eps=1e-8,
                weight_decay=weight_decay,
                mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p),
            ),
        )
        self.opt_state = self.tx.init(self.params)
        graphdef, tx = self.graphdef, self.tx

        def token_losses(params, toks):
            m = nnx.merge(graphdef, params)
            x, y = toks[:, :-1], toks[:, 1:]
            pos = jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32)[None], x.shape)
            logits, _ = m(x, pos)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y)

        def loss_fn(params, toks):
            return token_losses(params, toks).mean()

        def train_step(params, opt_state, toks):
            loss, grads = jax.value_and_grad(loss_fn)(params, toks)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        def eval_step(params, toks, weights):
            return (token_losses(params, toks).sum(axis=1) * weights).sum()

        def predict(params, toks):
            m = nnx.merge(graphdef, params)
            pos = jnp.broadcast_to(jnp.arange(toks.shape[1], dtype=jnp.int32)[None], toks.shape)
            return jnp.argmax(m(toks, pos)[0], axis=-1)

        def last_logits(params, toks, idx):
            m = nnx.merge(graphdef, params)
            pos = jnp.arange(toks.shape[1], dtype=jnp.int32)[None]
            logits, _ = m(toks, pos)
            return logits[0, idx]

        self._train_step = jax.jit(train_step, donate_argnums=(0, 1))
        self._eval_step = jax.jit(eval_step)
        self._last_logits = jax.jit(last_logits)
        self._predict = jax.jit(predict)

    def step(self, toks: np.ndarray):
        self.params, self.opt_state, loss = self._train_step(self.params, self.opt_state, jnp.asarray(toks))
        return loss

    def evaluate(self, windows: np.ndarray, batch: int = 16) -> float:
        """Mean next-token cross-entropy (nats) over all targets of the windows."""
        total = 0.0
        for i in range(0, len(windows), batch):
            chunk = windows[i : i + batch]
            w = np.zeros(batch, np.float32)
            w[: len(chunk)] = 1.0
            if len(chunk) < batch:
                chunk = np.concatenate([chunk, np.zeros((batch - len(chunk), chunk.shape[1]), np.int32)])
            total += float(self._eval_step(self.params, jnp.asarray(chunk), jnp.asarray(w)))
        return total / (len(windows) * (windows.shape[1] - 1))

    def predictions(self, windows: np.ndarray, batch: int = 16) -> np.ndarray:
        """Greedy (argmax) next-token predictions [n, seq_len] for the windows' inputs."""
        out = []
        for i in range(0, len(windows), batch):
            chunk = windows[i : i + batch, :-1]
            n = len(chunk)
            if n < batch:
                chunk = np.concatenate([chunk, np.zeros((batch - n, chunk.shape[1]), np.int32)])
            out.append(np.asarray(self._predict(self.params, jnp.asarray(chunk)))[:n])
        return np.concatenate(out)

    def model(self):
        return nnx.merge(self.graphdef, self.params)

    def greedy(self, ids: list[int], max_new: int, eos_id: int, buf: int = 256) -> list[int]:
        """Recompute-every-token greedy decoding over a fixed-size right-padded buffer
        (causal attention makes the padding harmless), so one compilation serves all."""
        toks = np.zeros((1, buf), np.int32)
        toks[0, : len(ids)] = ids
        n, out = len(ids), []
        for _ in range(min(max_new, buf - n)):
            nxt = int(jnp.argmax(self._last_logits(self.params, jnp.asarray(toks), n - 1)))
            if nxt == eos_id:
                break
            out.append(nxt)
            toks[0, n] = nxt
            n += 1
        return out


def train_model(
    label: str,
    trainer: Trainer,
    stream: np.ndarray,
    heldout_probe: np.ndarray,
    steps: int,
    batch: int,
    seq_len: int,
    seed: int,
    eval_every: int,
    log_every: int,
) -> dict:
    rng = np.random.default_rng(seed)
    hist = {"step": [], "loss": [], "eval_step": [], "eval_loss": []}
    pending = []
    t0 = time.time()
    last_t, last_step = t0, 0
    for step in range(1, steps + 1):
        starts = rng.integers(0, len(stream) - seq_len - 1, size=batch)
        toks = stream[starts[:, None] + np.arange(seq_len + 1)[None]]
        pending.append((step, trainer.step(toks)))
        if step % log_every == 0 or step == steps:
            for s, l in pending:
                hist["step"].append(s)
                hist["loss"].append(float(l))
            pending = []
            now = time.time()
            tps = (step - last_step) * batch * seq_len / (now - last_t)
            log(
                f"[{label}] step {step:5d}/{steps}  loss {hist['loss'][-1]:.4f}  "
                f"lr {float(trainer.schedule(step)):.2e}  {tps:,.0f} tok/s  {now - t0:7.1f}s"
            )
            last_t, last_step = now, step
        if step % eval_every == 0 or step == steps:
            ev = trainer.evaluate(heldout_probe)
            hist["eval_step"].append(step)
            hist["eval_loss"].append(ev)
            log(f"[{label}] step {step:5d}  held-out probe loss {ev:.4f}")
            last_t = time.time()
    hist["train_seconds"] = time.time() - t0
    return hist


def unigram_loss(train_stream: np.ndarray, targets: np.ndarray, vocab: int) -> float:
    counts = np.bincount(train_stream, minlength=vocab).astype(np.float64)
    logp = np.log(counts + 1.0) - np.log(counts.sum() + vocab)
    return float(-logp[targets].mean())


def plot_curves(hists: dict, final: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colors = {"target": "tab:blue", "draft": "tab:orange"}
    for name, h in hists.items():
        c = colors.get(name)
        loss = np.asarray(h["loss"])
        ax.plot(h["step"], loss, color=c, alpha=0.25, lw=0.8)
        k = 25
        if len(loss) > k:
            smooth = np.convolve(loss, np.ones(k) / k, mode="valid")
            ax.plot(h["step"][k - 1 :], smooth, color=c, lw=1.6, label=f"{name} train (moving avg {k})")
        ax.plot(h["eval_step"], h["eval_loss"], "o--", color=c, ms=4, lw=1, label=f"{name} held-out (probe)")
    if "unigram" in final:
        ax.axhline(final["unigram"], color="gray", ls=":", label=f"unigram baseline {final['unigram']:.2f}")
    ax.set_xlabel("step")
    ax.set_ylabel("next-token cross-entropy (nats)")
    ax.set_title("jaxserve default model: Python stdlib, byte-level BPE")
    top = max([final.get("unigram", 0.0) + 0.7] + [max(h["eval_loss"]) + 0.2 for h in hists.values()])
    ax.set_ylim(bottom=max(0.0, min(min(h["loss"]) for h in hists.values()) - 0.3), top=top)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- export checks


def verify_checkpoint(path: Path, prompt: str, n_new: int = 16) -> list[int]:
    """Reload with jaxserve's loader and with transformers; greedy continuations must agree."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jaxserve.models.loader import load_model

    tok = AutoTokenizer.from_pretrained(str(path))
    ids = tok(prompt)["input_ids"]
    jm, cfg = load_model(path, dtype=jnp.float32, use_cache=False)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        hf_out = hf.generate(
            torch.tensor([ids]), max_new_tokens=n_new, do_sample=False, eos_token_id=None, pad_token_id=tok.pad_token_id
        )[0, len(ids) :].tolist()
        hf_logits = hf(torch.tensor([ids])).logits[0].numpy()
    seq = list(ids)
    for _ in range(n_new):
        t = jnp.asarray([seq], jnp.int32)
        logits, _ = jm(t, jnp.arange(len(seq), dtype=jnp.int32)[None])
        seq.append(int(jnp.argmax(logits[0, -1])))
    j_out = seq[len(ids) :]
    j_logits, _ = jm(jnp.asarray([ids], jnp.int32), jnp.arange(len(ids), dtype=jnp.int32)[None])
    diff = float(np.abs(np.asarray(j_logits[0]) - hf_logits).max())
    log(f"[verify] {path}: max |logit diff| jaxserve vs transformers {diff:.2e}; greedy agree: {j_out == hf_out}")
    if j_out != hf_out or diff > 1e-3:
        raise SystemExit(f"verify failed for {path}: {j_out} vs {hf_out}, diff {diff}")
    return j_out


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# ----------------------------------------------------------------------------- main


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "assets" / "models" / "default")
    ap.add_argument("--plot", type=Path, default=ROOT / "docs" / "img" / "default-model-loss.png")
    ap.add_argument("--results-json", type=Path, default=None, help="also write the metrics here")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--heldout-modulus", type=int, default=50, help="hold out files with sha256(path) %% M == 0")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-position-embeddings", type=int, default=2048)
    ap.add_argument("--target-steps", type=int, default=1600)
    ap.add_argument("--draft-steps", type=int, default=1000)
    ap.add_argument("--target-lr", type=float, default=3e-3)
    ap.add_argument("--draft-lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--probe-windows", type=int, default=32, help="held-out windows for the periodic probe")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--sample-tokens", type=int, default=64)
    ap.add_argument(
        "--smoke", action="store_true", help="tiny end-to-end check: 60 files, vocab 512, small models, a few steps"
    )
    args = ap.parse_args(argv)

    t_start = time.time()
    target_shape = dict(hidden=256, layers=6, heads=8, kv_heads=4, inter=688, tie=False)
    draft_shape = dict(hidden=128, layers=2, heads=4, kv_heads=2, inter=384, tie=True)
    if args.smoke:
        args.vocab_size, args.target_steps, args.draft_steps = 512, 6, 6
        args.eval_every, args.log_every, args.warmup, args.sample_tokens = 3, 2, 2, 12
        args.seq_len, args.batch_size, args.probe_windows = 64, 4, 4
        target_shape = dict(hidden=64, layers=2, heads=4, kv_heads=2, inter=128, tie=False)
        draft_shape = dict(hidden=32, layers=1, heads=2, kv_heads=1, inter=64, tie=True)

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = collect_files(stdlib)
    if args.smoke:
        files = files[:: max(1, len(files) // 60)]
    train_files = [(r, t) for r, t in files if not is_heldout(r, args.heldout_modulus)]
    held_files = [(r, t) for r, t in files if is_heldout(r, args.heldout_modulus)]
    if args.smoke and not held_files:
        held_files, train_files = train_files[:2], train_files[2:]
    log(
        f"python {sys.version.split()[0]} stdlib {stdlib}: {len(files)} files "
        f"({sum(len(t) for _, t in files) / 1e6:.1f} MB), {len(train_files)} train, {len(held_files)} held out"
    )
    log("held-out files: " + ", ".join(r for r, _ in held_files))

    t0 = time.time()
    tok = train_tokenizer([t for _, t in train_files], args.vocab_size)
    train_stream = token_stream(tok, [t for _, t in train_files])
    held_stream = token_stream(tok, [t for _, t in held_files])
    n_train_bytes = sum(len(t.encode()) for _, t in train_files)
    t_tok = time.time() - t0
    log(
        f"tokenizer: vocab {tok.get_vocab_size()} trained in {t_tok:.1f}s; train {len(train_stream):,} tokens "
        f"({n_train_bytes / len(train_stream):.2f} bytes/token), held-out {len(held_stream):,} tokens"
    )
    vocab = tok.get_vocab_size()

    windows = eval_windows(held_stream, args.seq_len)
    probe = windows[:: max(1, len(windows) // args.probe_windows)][: args.probe_windows]
    targets = windows[:, 1:].reshape(-1)
    uni = unigram_loss(train_stream, targets, vocab)
    log(
        f"held-out: {len(windows)} windows of {args.seq_len} ({targets.size:,} predicted tokens); "
        f"unigram loss {uni:.4f} (ppl {math.exp(uni):.1f})"
    )

    cfgs = {
        "target": make_config("target", vocab, max_pos=args.max_position_embeddings, **target_shape),
        "draft": make_config("draft", vocab, max_pos=args.max_position_embeddings, **draft_shape),
    }
    plan = {
        "target": (args.target_steps, args.target_lr, args.seed),
        "draft": (args.draft_steps, args.draft_lr, args.seed + 1),
    }
    trainers, hists, nparams = {}, {}, {}
    for name, cfg in cfgs.items():
        steps, lr, seed = plan[name]
        tr = Trainer(cfg, seed, lr, args.warmup, steps, args.weight_decay)
        nparams[name] = count_params(tr.model())
        assert nparams[name] == cfg.num_params(), (nparams[name], cfg.num_params())
        log(f"[{name}] {nparams[name]:,} parameters: {json.dumps(dataclasses.asdict(cfg))}")
        log(
            f"[{name}] {steps} steps x {args.batch_size} x {args.seq_len} tokens, AdamW lr {lr} "
            f"(warmup {args.warmup}, cosine to {lr * 0.1:g}), weight decay {args.weight_decay}, init std 0.02 "
            f"(o_proj/down_proj / sqrt(2 x {cfg.num_layers} layers))"
        )
        hists[name] = train_model(
            name,
            tr,
            train_stream,
            probe,
            steps,
            args.batch_size,
            args.seq_len,
            seed + 1000,
            args.eval_every,
            args.log_every,
        )
        trainers[name] = tr
        log(f"[{name}] trained in {hists[name]['train_seconds']:.1f}s")
    ratio = nparams["draft"] / nparams["target"]
    log(f"draft/target parameters: {ratio:.3f}")
    assert ratio <= 0.2, ratio

    t0 = time.time()
    final = {"unigram": uni}
    for name, tr in trainers.items():
        final[name] = tr.evaluate(windows)
    preds = {name: tr.predictions(windows) for name, tr in trainers.items()}
    accuracy = {name: float((p == windows[:, 1:]).mean()) for name, p in preds.items()}
    agreement = float((preds["target"] == preds["draft"]).mean())
    t_eval = time.time() - t0
    log("held-out results (nats/token, perplexity, greedy next-token accuracy):")
    for name in ("target", "draft", "unigram"):
        acc = f"  top-1 {accuracy[name]:.3f}" if name in accuracy else ""
        log(f"  {name:8s} loss {final[name]:.4f}  ppl {math.exp(final[name]):8.2f}{acc}")
    log(f"draft's greedy token equals the target's at {agreement:.3f} of held-out positions")
    plot_curves(hists, final, args.plot)
    log(f"loss curves -> {args.plot}")

    samples = {}
    eos_id = SPECIALS.index(EOS)
    for name, tr in trainers.items():
        samples[name] = {}
        for p in PROMPTS:
            ids = tok.encode(p).ids
            out = tr.greedy(ids, args.sample_tokens, eos_id)
            samples[name][p] = tok.decode(out)
            log(f"----- [{name}] greedy completion of {p!r}:\n{p}{samples[name][p]}\n")

    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, model_max_length=args.max_position_embeddings
    )
    sizes = {}
    for name, tr in trainers.items():
        d = args.out / name
        save_hf_checkpoint(tr.model(), cfgs[name], d, hf_tok)
        sizes[name] = dir_size(d)
        log(f"[{name}] exported to {d} ({sizes[name] / 1e6:.2f} MB)")
    for name in trainers:
        verify_checkpoint(args.out / name, PROMPTS[0])

    total = time.time() - t_start
    log(
        f"wall time: total {total:.0f}s (tokenizer+data {t_tok:.0f}s, target {hists['target']['train_seconds']:.0f}s, "
        f"draft {hists['draft']['train_seconds']:.0f}s, final eval {t_eval:.0f}s)"
    )
    if args.results_json:
        args.results_json.parent.mkdir(parents=True, exist_ok=True)
        args.results_json.write_text(
            json.dumps(
                {
                    "params": nparams,
                    "heldout_loss": final,
                    "heldout_top1": accuracy,
                    "draft_target_agreement": agreement,
                    "heldout_ppl": {k: math.exp(v) for k, v in final.items()},
                    "heldout_tokens": int(targets.size),
                    "train_tokens": int(len(train_stream)),
                    "files": {"train": len(train_files), "heldout": [r for r, _ in held_files]},
                    "seconds": {
                        "total": total,
                        "tokenizer": t_tok,
                        "target": hists["target"]["train_seconds"],
                        "draft": hists["draft"]["train_seconds"],
                        "eval": t_eval,
                    },
                    "sizes": sizes,
                    "samples": samples,
                    "hists": hists,
                    "args": {k: str(v) for k, v in vars(args).items()},
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
