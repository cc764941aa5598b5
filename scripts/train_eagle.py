"""Train the EAGLE draft head (jaxserve/models/eagle.py) for the default model, on 2 CPU cores.

    .venv/bin/python scripts/train_eagle.py data  --work /tmp/eagle      # prompts -> target's replies -> features
                                              # (--corpus large: 5.5x the replies, ~1 hour on 2 cores)
    .venv/bin/python scripts/train_eagle.py train --work /tmp/eagle      # the head, teacher-forced
    .venv/bin/python scripts/train_eagle.py eval  --work /tmp/eagle      # chain-drafting acceptance, held out
    .venv/bin/python scripts/train_eagle.py export --work /tmp/eagle --out jaxserve/drafts/smollm2-135m-instruct-eagle

Reproducible: every prompt comes from text the Python installation ships (the standard
library's docstrings: "what does X do", "write a function that ...", "explain ..."), split by
module into training and held-out sets; the labels are the target's own outputs (its greedy
replies, then its argmax at every position of prompt + reply), so the head learns what the
target says, not what some corpus says. Seeds are fixed.

The head reads the target's final-norm feature at j - 1 and token j and predicts the feature at
j; it is trained with a smooth-L1 regression to that feature plus cross-entropy to the target's
argmax over the draft vocabulary (EAGLE's loss), with uniform noise on the input features (at
drafting time it reads its own, imperfect, predictions). Its layer starts as a copy of the
target's last decoder layer, its vocabulary projection as the target's rows of the draft
vocabulary (the most frequent target tokens in the training replies).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import json
import sys
import time
from pathlib import Path

import numpy as np

MODULES = [
    "os", "os.path", "re", "json", "string", "textwrap", "itertools", "functools", "collections", "math",
    "statistics", "random", "datetime", "time", "calendar", "pathlib", "shutil", "glob", "fnmatch", "tempfile",
    "csv", "sqlite3", "zipfile", "tarfile", "gzip", "hashlib", "hmac", "secrets", "base64", "binascii", "struct",
    "copy", "pprint", "heapq", "bisect", "array", "enum", "operator", "typing", "dataclasses", "abc",
    "contextlib", "inspect", "logging", "argparse", "subprocess", "threading", "queue", "asyncio", "socket",
    "urllib.parse", "http.client", "email.utils", "html", "xml.etree.ElementTree", "unicodedata", "decimal",
    "fractions", "cmath", "uuid", "io", "pickle", "shlex", "difflib", "locale", "gettext", "platform", "sys",
    "traceback", "warnings", "weakref", "types", "codecs", "mimetypes", "ipaddress", "sched", "selectors",
    "signal", "stat", "filecmp", "linecache", "tokenize", "keyword", "ast", "dis", "timeit", "cProfile",
    "zlib", "bz2", "lzma", "configparser", "getpass", "graphlib", "numbers", "colorsys", "wave", "turtle",
]  # fmt: skip

KINDS = [
    "What does the Python function `{q}` do? Give a short example.",
    "Write a Python function that {s}",
    "Explain in simple terms: {s}",
    "How would I use `{q}` in a script? Keep it short.",
]

CHAT = [
    "What is the capital of {c}?", "Tell me a fun fact about {c}.", "What language do people speak in {c}?",
]  # fmt: skip
COUNTRIES = [
    "France", "Japan", "Brazil", "Canada", "Egypt", "India", "Kenya", "Mexico", "Norway", "Peru", "Spain",
    "Italy", "Germany", "Chile", "Greece", "Turkey", "Vietnam", "Ghana", "Poland", "Sweden", "Nigeria",
    "Argentina", "Thailand", "Portugal",
]  # fmt: skip


def held_out(name: str) -> bool:
    return int(hashlib.sha1(name.encode()).hexdigest(), 16) % 5 == 0


# Excluded from --corpus large: modules with side effects on import or none of their own text.
SKIP = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "lib2to3", "ensurepip", "venv"}
TOPIC_KINDS = [
    "Explain Python's {t} in simple terms.",
    "Give a short example of {t} in Python and say what it does.",
    "What should a beginner know about {t} in Python?",
]


def prompts(corpus: str = "small") -> tuple[list[str], list[str]]:
    """(training, held-out) user messages from the standard library's docstrings and a few chat
    questions; a module's prompts are all in one set. `large`: every importable standard-library
    module, up to 40 functions each, two phrasings per function, and the language reference's
    topics (pydoc_data) -- about 5x the replies of `small`."""
    train, held = [], []
    if corpus == "large":
        import pydoc_data.topics

        modules = [m for m in sorted(sys.stdlib_module_names) if not m.startswith("_") and m not in SKIP]
        per_module, kinds_per_function, topics = 40, 2, sorted(pydoc_data.topics.topics)
    else:
        modules, per_module, kinds_per_function, topics = MODULES, 12, 1, []
    for mod_name in modules:
        try:
            mod = importlib.import_module(mod_name)
        except Exception:  # noqa: BLE001  (a module this Python lacks)
            continue
        out = held if held_out(mod_name) else train
        names = sorted(n for n in dir(mod) if not n.startswith("_"))
        n_used = 0
        for i, n in enumerate(names):
            obj = getattr(mod, n, None)
            if not (inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.isclass(obj)):
                continue
            doc = inspect.getdoc(obj) or ""
            first = doc.split("\n\n")[0].replace("\n", " ").strip()
            if not (20 <= len(first) <= 300) or first.startswith(n + "("):
                continue
            s = first[0].lower() + first[1:]
            for j in range(kinds_per_function):
                kind = KINDS[(i + j + len(mod_name)) % len(KINDS)]
                out.append(kind.format(q=f"{mod_name}.{n}", s=s))
            n_used += 1
            if n_used >= per_module:
                break
    for i, c in enumerate(COUNTRIES):
        (held if held_out(c) else train).append(CHAT[i % len(CHAT)].format(c=c))
    for t in topics:
        words = t.replace("-", " ")
        (held if held_out(t) else train).extend(k.format(t=words) for k in TOPIC_KINDS)
    return train, held


def cmd_data(args) -> None:
    from jaxserve import LLM, SamplingParams
    from jaxserve.models.loader import load_model
    from jaxserve.models.registry import default_model

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    train, held = prompts(args.corpus)
    print(f"{len(train)} training prompts, {len(held)} held out")
    seqs_file = work / "sequences.json"
    if seqs_file.exists():
        seqs = json.loads(seqs_file.read_text())
    else:
        llm = LLM(max_slots=args.batch)
        sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
        seqs = {}
        for split, ps in (("train", train), ("held", held)):
            t0 = time.time()
            outs = llm.chat([[{"role": "user", "content": p}] for p in ps], sp)
            seqs[split] = [list(o.prompt_token_ids) + list(o.token_ids) for o in outs]
            n = sum(len(o.token_ids) for o in outs)
            print(f"{split}: {n} reply tokens in {time.time() - t0:.0f}s", flush=True)
        seqs_file.write_text(json.dumps(seqs))
        (work / "prompts.json").write_text(json.dumps({"train": train, "held": held}, indent=0))
        del llm

    import jax
    import jax.numpy as jnp

    model, cfg = load_model(default_model(), dtype=jnp.float32)

    @jax.jit
    def feats(tokens, positions):
        logits, _, hidden = model(tokens, positions, return_hidden=True)
        return hidden.astype(jnp.float16), jnp.argmax(logits, -1).astype(jnp.int32)

    for split in ("train", "held"):
        toks, fs, labels, offsets = [], [], [], [0]
        t0 = time.time()
        batch = sorted(seqs[split], key=len)
        for i in range(0, len(batch), 4):
            group = batch[i : i + 4]
            t = max(len(s) for s in group)
            t = -(-t // 64) * 64
            arr = np.zeros((len(group), t), np.int32)
            for j, s in enumerate(group):
                arr[j, : len(s)] = s
            pos = np.broadcast_to(np.arange(t, dtype=np.int32), arr.shape)
            h, lab = feats(jnp.asarray(arr), jnp.asarray(pos))
            h, lab = np.asarray(h), np.asarray(lab)
            for j, s in enumerate(group):
                toks.append(np.asarray(s, np.int32))
                fs.append(h[j, : len(s)])
                labels.append(lab[j, : len(s)])
                offsets.append(offsets[-1] + len(s))
        np.savez(
            work / f"{split}.npz",
            tokens=np.concatenate(toks),
            features=np.concatenate(fs),
            labels=np.concatenate(labels),
            offsets=np.asarray(offsets, np.int64),
        )
        print(f"{split}: features of {offsets[-1]} tokens in {time.time() - t0:.0f}s")


def _load(work: Path, split: str):
    d = np.load(work / f"{split}.npz")
    return d["tokens"], d["features"], d["labels"], d["offsets"]


def _windows(offsets, length: int, rng) -> list[tuple[int, int]]:
    """(start, stop) windows of at most `length` tokens covering every sequence."""
    out = []
    for a, b in zip(offsets[:-1], offsets[1:]):
        for s in range(int(a), int(b), length):
            out.append((s, min(s + length, int(b))))
    rng.shuffle(out)
    return out


def _batch(windows, tokens, features, labels, seq_start, length: int):
    n = len(windows)
    h = features.shape[1]
    tok = np.zeros((n, length), np.int32)
    pos = np.zeros((n, length), np.int32)
    prev = np.zeros((n, length, h), np.float32)
    tgt = np.zeros((n, length, h), np.float32)
    lab = np.zeros((n, length), np.int32)
    mask = np.zeros((n, length), np.float32)
    for i, (a, b) in enumerate(windows):
        m = b - a
        s0 = seq_start[a]
        tok[i, :m] = tokens[a:b]
        pos[i, :m] = np.arange(a - s0, b - s0)
        lo = max(a - 1, s0)
        pf = features[lo : b - 1].astype(np.float32)
        prev[i, m - len(pf) : m] = pf  # position 0 of a sequence reads zeros
        tgt[i, :m] = features[a:b]
        lab[i, :m] = labels[a:b]
        mask[i, :m] = 1.0
    return tok, pos, prev, tgt, lab, mask


def _seq_start(offsets, n):
    start = np.zeros((n,), np.int64)
    for a, b in zip(offsets[:-1], offsets[1:]):
        start[a:b] = a
    return start


def cmd_train(args) -> None:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jaxserve.models import eagle
    from jaxserve.models.loader import load_model
    from jaxserve.models.registry import default_model

    work = Path(args.work)
    tokens, features, labels, offsets = _load(work, "train")
    target, tcfg = load_model(default_model(), dtype=jnp.float32)
    # The draft vocabulary: the target's most frequent argmax tokens over the training data.
    counts = np.bincount(labels, minlength=tcfg.vocab_size)
    order = np.argsort(-counts, kind="stable")
    d2t = np.sort(order[: args.draft_vocab]).astype(np.int32)
    coverage = counts[d2t].sum() / counts.sum()
    print(f"draft vocabulary {args.draft_vocab}: covers {coverage:.4f} of the target's training argmaxes")
    t2d = np.full((tcfg.vocab_size,), -1, np.int32)
    t2d[d2t] = np.arange(len(d2t))

    cfg = eagle.EagleConfig.for_target(tcfg, args.draft_vocab)
    head = eagle.EagleHead(cfg, dtype=jnp.float32, rngs=nnx.Rngs(args.seed))
    h = tcfg.hidden_size
    # Start from the target: its last layer, its LM head rows, its embedding (frozen: shared
    # at serving time); fc passes the feature through and adds a little of the embedding.
    last = target.layers[-1]
    for name in ("input_layernorm", "post_attention_layernorm"):
        getattr(head.layer, name).weight[...] = getattr(last, name).weight[...]
    for part, names in (
        ("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
        ("mlp", ("gate_proj", "up_proj", "down_proj")),
    ):
        for n in names:
            getattr(getattr(head.layer, part), n).kernel[...] = getattr(getattr(last, part), n).kernel[...]
    emb = target.embed_tokens.embedding[...]
    head.embed_tokens.embedding[...] = emb
    head.lm_head.kernel[...] = emb[jnp.asarray(d2t)].T
    head.d2t[...] = jnp.asarray(d2t)
    fc = np.zeros((2 * h, h), np.float32)
    fc[h:] = np.eye(h, dtype=np.float32)
    fc[:h] = np.random.default_rng(args.seed).normal(0, 0.02, (h, h))
    head.fc.kernel[...] = jnp.asarray(fc)

    if args.resume:  # go on from a saved head (its draft vocabulary too)
        head, _ = eagle.load_head(args.resume, target, tcfg, jnp.float32)
        d2t = np.asarray(head.d2t[...])
        t2d = np.full((tcfg.vocab_size,), -1, np.int32)
        t2d[d2t] = np.arange(len(d2t))
        print(f"resuming from {args.resume}")

    trainable = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("embed_tokens")))
    if args.freeze_lm_head:
        trainable = nnx.All(trainable, nnx.Not(nnx.PathContains("lm_head")))
    rng = np.random.default_rng(args.seed)
    seq_start = _seq_start(offsets, len(tokens))
    steps_per_epoch = len(_windows(offsets, args.length, rng)) // args.batch
    total = steps_per_epoch * args.epochs
    sched = optax.warmup_cosine_decay_schedule(0.0, args.lr, min(100, total // 10), total, args.lr * 0.05)
    opt = nnx.Optimizer(
        head, optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(sched, weight_decay=0.0)), wrt=trainable
    )
    t2d_dev = jnp.asarray(t2d)

    def losses(model, tok, pos, prev, tgt, lab, mask):
        g, _ = model(tok, pos, prev)
        reg = jnp.sum(optax.huber_loss(g, tgt, delta=1.0).mean(-1) * mask) / mask.sum()
        logits = model.logits(g)
        dlab = t2d_dev[lab]
        ok = (dlab >= 0) & (mask > 0)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(dlab, 0))
        ce = jnp.sum(ce * ok) / jnp.maximum(ok.sum(), 1)
        acc = jnp.sum((jnp.argmax(logits, -1) == dlab) * ok) / jnp.maximum(mask.sum(), 1)
        return args.reg_weight * reg + args.ce_weight * ce, g, (reg, ce, acc)

    def loss_fn(model, tok, pos, prev, tgt, lab, mask, key):
        noise = jax.random.uniform(key, prev.shape, minval=-args.noise, maxval=args.noise)
        loss, g, aux = losses(model, tok, pos, prev + noise, tgt, lab, mask)
        # Training-time test (EAGLE-3): drafting past the first token reads the head's own
        # predicted features; later passes feed each position the previous pass's prediction
        # of its previous feature, as the second, third... drafting step does.
        for _ in range(args.unroll - 1):
            own = jnp.concatenate([prev[:, :1], jax.lax.stop_gradient(g[:, :-1])], axis=1)
            more, g, _ = losses(model, tok, pos, own, tgt, lab, mask)
            loss = loss + more
        return loss, aux

    @nnx.jit
    def train_step(model, opt, tok, pos, prev, tgt, lab, mask, key):
        (loss, aux), grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, trainable), has_aux=True)(
            model, tok, pos, prev, tgt, lab, mask, key
        )
        opt.update(model, grads)
        return loss, aux

    key = jax.random.key(args.seed)
    t0 = time.time()
    step = 0
    for epoch in range(args.epochs):
        wins = _windows(offsets, args.length, rng)
        for i in range(0, len(wins) - args.batch + 1, args.batch):
            b = _batch(wins[i : i + args.batch], tokens, features, labels, seq_start, args.length)
            key, sub = jax.random.split(key)
            loss, (reg, ce, acc) = train_step(head, opt, *map(jnp.asarray, b), sub)
            step += 1
            if step % 25 == 0 or step == total:
                print(
                    f"epoch {epoch} step {step}/{total}: loss {float(loss):.4f} reg {float(reg):.4f} "
                    f"ce {float(ce):.3f} acc {float(acc):.3f} ({time.time() - t0:.0f}s)",
                    flush=True,
                )
    out = Path(args.save) if args.save else work / "head"
    eagle.save_head(head, out)
    print(f"saved {out}")


def _load_head(work: Path, path: Path | None = None):
    import jax.numpy as jnp

    from jaxserve.models import eagle
    from jaxserve.models.loader import load_model
    from jaxserve.models.registry import default_model

    target, tcfg = load_model(default_model(), dtype=jnp.float32)
    head, _ = eagle.load_head(path or work / "head", target, tcfg, jnp.float32)
    return head


def cmd_eval(args) -> None:
    """Chain drafting on held-out replies, as serving runs it: at each reply position the head
    reads the target's feature, then its own for k steps; a draft is accepted while it equals
    the target's greedy token. Reports the mean tokens per target step (accepted + 1)."""
    import jax
    import jax.numpy as jnp

    work = Path(args.work)
    head = _load_head(work, Path(args.head) if args.head else None)
    tokens, features, labels, offsets = _load(work, "held")
    k = args.k
    d2t = jnp.asarray(head.d2t[...])

    @jax.jit
    def draft_chain(tok, pos, feat):
        # dense attention over a window that ends at the drafting position: the head's KV
        # context is its own teacher-forced past, as the serving cache holds it
        outs = []
        t = tok
        f = feat
        p = pos
        for _ in range(k):
            g, _ = head(t, p, f)
            nxt = d2t[jnp.argmax(head.logits(g[:, -1]), -1)]
            outs.append(nxt)
            t = jnp.concatenate([t[:, 1:], nxt[:, None]], axis=1)
            f = jnp.concatenate([f[:, 1:], g[:, -1:]], axis=1)
            p = p + 1
        return jnp.stack(outs, 1)

    ctx = 64
    accepted = []
    for a, b in zip(offsets[:-1], offsets[1:]):
        a, b = int(a), int(b)
        # drafting positions inside the reply part (after the prompt): the last 60% of the sequence
        for L in range(max(a + ctx, b - (b - a) * 6 // 10), b - k - 1, args.stride):
            tok = tokens[L - ctx + 1 : L + 1][None]
            feat = np.concatenate([features[L - ctx : L]], 0)[None].astype(np.float32)
            pos = np.arange(L - ctx + 1 - a, L + 1 - a, dtype=np.int32)[None]
            d = np.asarray(draft_chain(jnp.asarray(tok), jnp.asarray(pos), jnp.asarray(feat)))[0]
            want = labels[L : L + k]  # the target's greedy tokens after position L
            n = 0
            while n < k and d[n] == want[n]:
                n += 1
            accepted.append(n)
    acc = np.asarray(accepted)
    by_pos = [(acc > i).mean() for i in range(k)]
    print(
        f"held-out chain drafting, k={k}: {len(acc)} positions, mean tokens per target step "
        f"{1 + acc.mean():.3f}; P(first i accepted) {', '.join(f'{x:.3f}' for x in by_pos)}"
    )


def cmd_export(args) -> None:
    """The trained head as a shippable copy: float16 weights (half the size)."""
    from safetensors.numpy import load_file, save_file

    work, out = Path(args.work), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    arrays = load_file(str(work / "head" / "model.safetensors"))
    arrays = {k: (v if k == "d2t" else v.astype(np.float16)) for k, v in arrays.items()}
    save_file(arrays, str(out / "model.safetensors"))
    cfg = json.loads((work / "head" / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    print(f"wrote {out}: {sum(v.nbytes for v in arrays.values()) / 2**20:.1f} MiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["data", "train", "eval", "export"])
    ap.add_argument("--work", default="/tmp/eagle")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--noise", type=float, default=0.1)
    ap.add_argument("--ce-weight", type=float, default=0.1)
    ap.add_argument("--reg-weight", type=float, default=1.0, help="0: EAGLE-3's loss, cross-entropy only")
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--freeze-lm-head", action="store_true")
    ap.add_argument("--resume", default=None, help="a saved head to go on training")
    ap.add_argument("--save", default=None, help="where to save the head (default: WORK/head)")
    ap.add_argument("--unroll", type=int, default=2, help="training-time test passes (1: teacher forcing only)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corpus", choices=["small", "large"], default="small", help="data: the prompt set")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--stride", type=int, default=7)
    ap.add_argument("--head", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    {"data": cmd_data, "train": cmd_train, "eval": cmd_eval, "export": cmd_export}[args.command](args)


if __name__ == "__main__":
    main()
