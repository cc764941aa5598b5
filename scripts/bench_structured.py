"""Structured output on the shipped default model: validity and throughput.

    .venv/bin/python scripts/bench_structured.py --validate [--requests 200]
        every constrained output of a mixed batch (a dozen JSON schemas, regexes and a Lark
        grammar, greedy and sampled, mixed with unconstrained requests) parses and validates
        (jsonschema / re.fullmatch), and the unconstrained requests are token for token what
        they are alone;
    .venv/bin/python scripts/bench_structured.py [--batch 16] [--requests 64] [--repeats 3]
        throughput of a batch where half the rows are JSON-constrained against the same batch
        unconstrained (the same prompts and token budgets), and the host time spent computing
        grammar bitmasks per step;
    .venv/bin/python scripts/bench_structured.py --engines ENGINE
        how the grammar engine was chosen: compile time and per-token mask time of llguidance,
        xgrammar or outlines-core (pip install the candidate first: xgrammar also pulls torch
        and triton) on the default model's 4,096-token vocabulary and on a 32,000-token
        byte-level BPE trained here on Python's standard library, along valid outputs.

The default model was trained on Python source only, never on JSON: the constraint alone
makes the output valid. Every schema bounds its strings, arrays and numbers (numbers by
range and multipleOf), so the grammar itself forces termination within max_tokens.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string", "maxLength": 24},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "product": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9999},
            "title": {"type": "string", "maxLength": 16},
            "price": {"type": "number", "minimum": 0, "maximum": 1000, "multipleOf": 0.25},
            "in_stock": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        },
        "required": ["id", "title", "price", "in_stock"],
        "additionalProperties": False,
    },
    "box": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
            "dims": {
                "type": "object",
                "properties": {
                    "w": {"type": "number", "minimum": 0, "maximum": 10, "multipleOf": 0.5},
                    "h": {"type": "number", "exclusiveMinimum": 0, "maximum": 100, "multipleOf": 0.25},
                },
                "required": ["w", "h"],
                "additionalProperties": False,
            },
        },
        "required": ["id", "tags", "dims"],
        "additionalProperties": False,
    },
    "segment": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -100, "maximum": 100},
                    "y": {"type": "integer", "minimum": -100, "maximum": 100},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
            "qty": {"type": "integer", "minimum": 1, "maximum": 10},
        },
        "required": ["color", "size", "qty"],
        "additionalProperties": False,
    },
    "points": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "x": {"type": "integer", "minimum": -100, "maximum": 100},
                "y": {"type": "integer", "minimum": -100, "maximum": 100},
            },
            "required": ["x", "y"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 4,
    },
    "optional": {
        "type": "object",
        "properties": {
            "a": {"type": "string", "maxLength": 8},
            "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
            "c": {"type": "boolean"},
            "d": {"type": "null"},
        },
        "required": ["a"],
        "additionalProperties": False,
    },
    "matrix": {
        "type": "object",
        "properties": {
            "rows": {
                "type": "array",
                "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["rows"],
        "additionalProperties": False,
    },
    "choice": {
        "type": "object",
        "properties": {
            "kind": {"const": "answer"},
            "value": {
                "anyOf": [{"type": "integer", "minimum": 0, "maximum": 100}, {"type": "string", "maxLength": 10}]
            },
        },
        "required": ["kind", "value"],
        "additionalProperties": False,
    },
    "account": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "profile": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string", "minLength": 1, "maxLength": 10},
                            "langs": {"type": "array", "items": {"enum": ["py", "c", "go"]}, "maxItems": 2},
                        },
                        "required": ["name", "langs"],
                        "additionalProperties": False,
                    },
                    "active": {"type": "boolean"},
                },
                "required": ["profile", "active"],
                "additionalProperties": False,
            },
            "score": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.125},
        },
        "required": ["user", "score"],
        "additionalProperties": False,
    },
    "inventory": {
        "$defs": {
            "item": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 99},
                    "label": {"type": "string", "maxLength": 6},
                },
                "required": ["id", "label"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {
            "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "maxItems": 3},
            "count": {"type": "integer", "minimum": 0, "maximum": 3},
        },
        "required": ["items", "count"],
        "additionalProperties": False,
    },
    "ticket": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
            "level": {"enum": [1, 2, 3]},
            "note": {"type": ["string", "null"], "maxLength": 12},
        },
        "required": ["code", "level", "note"],
        "additionalProperties": False,
    },
}
REGEXES = [r"[0-9]{3}-[0-9]{4}", r"(yes|no|maybe)", r"[a-z]{2,8}@[a-z]{3,6}\.(com|org)", r"def [a-z_]{1,12}\(\):"]
GRAMMAR = r"""
start: expr
expr: NUM | NUM OP NUM | NUM OP NUM OP NUM
OP: "+" | "-" | "*"
NUM: /[0-9]{1,3}/
"""
GRAMMAR_RE = r"[0-9]{1,3}([-+*][0-9]{1,3}){0,2}"
PROMPTS = ["Output: ", "def parse(data):\n    return ", "# JSON\n", "import json\nx = ", "The answer is "]


def mixed_requests(n: int, seed: int = 0, max_tokens: int = 160, unconstrained_share: float = 0.2):
    """n requests mixing every schema, regex and the grammar, greedy and sampled, with about
    `unconstrained_share` plain ones: [(prompt, SamplingParams, (kind, spec))]."""
    import numpy as np

    from jaxserve.engine.request import SamplingParams

    rng = np.random.default_rng(seed)
    kinds = [("json_schema", name) for name in SCHEMAS] + [("regex", r) for r in REGEXES] + [("grammar", GRAMMAR)]
    out = []
    for i in range(n):
        prompt = PROMPTS[i % len(PROMPTS)]
        sampled = bool(i % 2)
        sampling = dict(temperature=0.8, top_p=0.95, seed=int(rng.integers(1 << 30))) if sampled else {"temperature": 0}
        if rng.random() < unconstrained_share:
            out.append((prompt, SamplingParams(max_tokens=24, ignore_eos=True, **sampling), (None, None)))
            continue
        kind, spec = kinds[i % len(kinds)]
        value = SCHEMAS[spec] if kind == "json_schema" else spec
        out.append((prompt, SamplingParams(max_tokens=max_tokens, **{kind: value}, **sampling), (kind, spec)))
    return out


def check(output, kind, spec) -> str | None:
    """None when a constrained output is complete and valid, else what is wrong."""
    import jsonschema

    if output.finish_reason != "stop":
        return f"finished by {output.finish_reason} after {len(output.token_ids)} tokens: {output.text!r}"
    if kind == "json_schema":
        try:
            jsonschema.validate(json.loads(output.text), SCHEMAS[spec])
        except (json.JSONDecodeError, jsonschema.ValidationError) as e:
            return f"{spec}: {type(e).__name__}: {str(e)[:200]} in {output.text!r}"
    elif kind == "regex" and not re.fullmatch(spec, output.text):
        return f"regex {spec!r} does not fullmatch {output.text!r}"
    elif kind == "grammar" and not re.fullmatch(GRAMMAR_RE, output.text):
        return f"grammar output {output.text!r}"
    return None


def validate(llm, n: int) -> dict:
    reqs = mixed_requests(n)
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _, _ in reqs], [sp for _, sp, _ in reqs])
    secs = time.perf_counter() - t0
    errors = [e for (_, _, (k, s)), o in zip(reqs, outs) if k and (e := check(o, k, s))]
    plain = [(i, p, sp) for i, (p, sp, (k, _)) in enumerate(reqs) if k is None]
    alone = llm.generate([p for _, p, _ in plain], [sp for _, _, sp in plain])
    differ = [i for (i, _, _), a in zip(plain, alone) if a.token_ids != outs[i].token_ids]
    return {
        "requests": n,
        "constrained": n - len(plain),
        "invalid": errors,
        "unconstrained": len(plain),
        "unconstrained_differ_from_alone": differ,
        "seconds": secs,
        "tokens": sum(len(o.token_ids) for o in outs),
    }


def throughput(llm, batch: int, n: int, repeats: int) -> dict:
    """Tokens per second of n requests through `batch` slots, half of them JSON-constrained,
    against the same requests unconstrained (same prompts, seeds and max_tokens; the
    unconstrained ones ignore EOS, the constrained ones stop when their JSON is complete)."""
    from jaxserve.engine.request import SamplingParams

    names = list(SCHEMAS)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    base = [dict(max_tokens=48, temperature=0.8 if i % 4 >= 2 else 0, seed=i) for i in range(n)]
    plain = [SamplingParams(ignore_eos=True, **b) for b in base]
    half = [
        SamplingParams(json_schema=SCHEMAS[names[i % len(names)]], **b) if i % 2 else p
        for i, (b, p) in enumerate(zip(base, plain))
    ]
    llm.generate(prompts[:batch], half[:batch])  # grammars compiled and cached, like a server's steady state
    runs = {"unconstrained": [], "half_constrained": []}
    mask = []
    for _ in range(repeats):
        for name, params in (("unconstrained", plain), ("half_constrained", half)):
            llm.flush_prefix_cache()
            st0 = llm.stats()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            secs = time.perf_counter() - t0
            st1 = llm.stats()
            runs[name].append(sum(len(o.token_ids) for o in outs) / secs)
            if name == "half_constrained":
                steps = st1["grammar_mask_steps"] - st0["grammar_mask_steps"]
                mask.append((st1["grammar_mask_seconds"] - st0["grammar_mask_seconds"]) / max(steps, 1))
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {
        "batch": batch,
        "requests": n,
        "tok_per_s": med,
        "runs": runs,
        "ratio": med["half_constrained"] / med["unconstrained"],
        "mask_ms_per_step": 1e3 * statistics.median(mask),
    }


def _tokenizers() -> dict:
    """{name: (HF fast tokenizer, vocab size)}: the default model's and a 32k BPE trained here."""
    import glob
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    small_dir = Path(__file__).resolve().parents[1] / "assets" / "models" / "default" / "target"

    texts, size = [], 0
    for f in sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/**/*.py", recursive=True)):
        if size > 8e6:
            break
        try:
            texts.append(open(f, encoding="utf-8").read())
        except (UnicodeDecodeError, OSError):
            continue
        size += len(texts[-1])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=32000, special_tokens=["<s>", "</s>"], initial_alphabet=alphabet)
    )
    big = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    small = PreTrainedTokenizerFast.from_pretrained(str(small_dir))
    return {"default-4096": (small, len(small)), "bpe-32000": (big, len(big))}


def _engine(name: str, tok, vocab: int):
    """(compile(kind, source) -> matcher, fill(matcher, mask), advance(matcher, token)) of one engine."""
    if name == "llguidance":
        import llguidance
        import llguidance.hf
        from llguidance.numpy import fill_next_token_bitmask

        from jaxserve.engine.structured import JSON_OPTIONS

        t = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
        L = llguidance.LLMatcher

        def compile_(kind, src):
            g = L.grammar_from_json_schema(src, defaults=JSON_OPTIONS) if kind == "json" else L.grammar_from_regex(src)
            return L(t, g)

        return compile_, lambda m, buf: fill_next_token_bitmask(m, buf, 0), lambda m, tid: m.consume_token(tid)
    if name == "xgrammar":
        import xgrammar as xgr

        compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab), max_threads=1)

        def compile_(kind, src):
            if kind == "json":
                g = compiler.compile_json_schema(json.dumps(src), any_whitespace=False, separators=(",", ":"))
            else:
                g = compiler.compile_regex(src)
            return xgr.GrammarMatcher(g)

        return compile_, lambda m, buf: m.fill_next_token_bitmask(buf, 0), lambda m, tid: m.accept_token(tid)
    if name == "outlines-core":
        import outlines_core as oc

        byte = {}  # GPT-2's byte-to-character table, inverted
        printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
        extra = iter(range(256, 512))
        for b in range(256):
            byte[chr(b) if b in printable else chr(next(extra))] = b
        vocab_map: dict[bytes, list[int]] = {}
        for text, i in tok.get_vocab().items():
            if i != tok.eos_token_id and text not in tok.all_special_tokens:
                vocab_map.setdefault(bytes(byte[c] for c in text), []).append(i)
        v = oc.Vocabulary(tok.eos_token_id, vocab_map)

        def compile_(kind, src):
            rx = oc.json_schema.build_regex_from_schema(json.dumps(src), None) if kind == "json" else src
            return oc.Guide(oc.Index(rx, v))

        def fill(g, buf):
            g.write_mask_into(buf.ctypes.data, buf.size, buf.itemsize)

        def advance(g, tid):
            g.advance(tid, return_tokens=False)  # raises on a token the guide does not allow
            return True

        return compile_, fill, advance
    raise SystemExit(f"unknown engine {name!r}: llguidance, xgrammar or outlines-core")


def compare_engines(name: str) -> dict:
    import numpy as np

    cases = {  # a valid output of each: the walk computes one mask per token of it
        "person": ("json", SCHEMAS["person"], {"name": "Ada", "age": 36}),
        "box": ("json", SCHEMAS["box"], {"id": 7, "tags": ["red", "blue"], "dims": {"w": 1.5, "h": 2}}),
        "segment": ("json", SCHEMAS["segment"], {"a": {"x": 1, "y": 2}, "b": {"x": -3, "y": 40}}),
        "regex": ("regex", REGEXES[0], "555-1234"),
    }
    out = {}
    for tname, (tok, vocab) in _tokenizers().items():
        compile_, fill, advance = _engine(name, tok, vocab)
        buf = np.zeros((1, (vocab + 31) // 32), np.int32)
        if name == "xgrammar":
            import torch

            buf = torch.zeros(buf.shape, dtype=torch.int32)
        for case, (kind, src, valid) in cases.items():
            text = valid if isinstance(valid, str) else json.dumps(valid, separators=(",", ":"))
            t0 = time.perf_counter()
            m = compile_(kind, src)
            compile_ms = 1e3 * (time.perf_counter() - t0)
            times, ids = [], tok.encode(text, add_special_tokens=False)
            for tid in ids:
                t0 = time.perf_counter()
                fill(m, buf)
                times.append(time.perf_counter() - t0)
                assert advance(m, tid), (name, case, tid)
            out[f"{tname}/{case}"] = {
                "compile_ms": round(compile_ms, 2),
                "mask_us_median": round(1e6 * statistics.median(times), 1),
                "mask_us_max": round(1e6 * max(times), 1),
                "tokens": len(ids),
            }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--validate", action="store_true", help="validity of a mixed batch instead of throughput")
    ap.add_argument("--requests", type=int, default=None, help="200 with --validate, else 64")
    ap.add_argument("--batch", type=int, default=16, help="decode slots")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engines", metavar="ENGINE", help="llguidance | xgrammar | outlines-core: the engine comparison")
    args = ap.parse_args(argv)
    if args.engines:
        print(json.dumps({args.engines: compare_engines(args.engines)}, indent=1))
        return 0
    from jaxserve import LLM

    t0 = time.perf_counter()
    small = Path(__file__).resolve().parents[1] / "assets" / "models" / "default" / "target"
    llm = LLM(small, max_slots=args.batch, max_model_len=512, token_buckets=(16, 32, 64))
    print(f"engine ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    if args.validate:
        r = validate(llm, args.requests or 200)
        ok = not r["invalid"] and not r["unconstrained_differ_from_alone"]
    else:
        r = throughput(llm, args.batch, args.requests or 64, args.repeats)
        ok = r["ratio"] >= 0.8
    r["compiles_after_warmup"] = llm.compiles_since_warmup()
    print(json.dumps(r, indent=1))
    return 0 if ok and r["compiles_after_warmup"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
