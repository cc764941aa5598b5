"""`jaxserve bench structured`: structured output's validity and its cost in throughput.

The requests (`mixed_requests`): a dozen JSON schemas, four regexes and a Lark grammar, greedy
and sampled, mixed with unconstrained requests. Every schema bounds its strings, arrays and
numbers, so the grammar itself ends each output within max_tokens; `check` is the oracle of an
output (jsonschema / re.fullmatch). tests/test_structured.py runs the same requests.

- --validate N: every constrained output of a mixed batch of N parses and validates, and every
  unconstrained request is token for token what it is alone (an error exit otherwise);
- else: output tokens per second of a batch whose odd requests are JSON-constrained against the
  same batch unconstrained (same prompts, seeds and budgets), rounds alternating, and the host's
  time per step computing grammar bitmasks.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from contextlib import ExitStack

from jaxserve.tools.bench import ab, flags, result

# an integer point in [-100, 100]^2, in two of the schemas
POINT = {
    "type": "object",
    "properties": {
        "x": {"type": "integer", "minimum": -100, "maximum": 100},
        "y": {"type": "integer", "minimum": -100, "maximum": 100},
    },
    "required": ["x", "y"],
    "additionalProperties": False,
}
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
        "$defs": {"point": POINT},
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
        "items": POINT,
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
    """The mixed batch once, every output checked; the unconstrained ones run again alone."""
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


def _throughput_requests(n: int, output_len: int):
    """(requests, [unconstrained params, half-constrained params]): the same prompts, seeds and
    budgets; unconstrained requests ignore EOS, constrained ones stop when their JSON is whole."""
    from jaxserve.engine.request import SamplingParams
    from jaxserve.tools.bench.workload import Request

    names = list(SCHEMAS)
    requests = [Request(PROMPTS[i % len(PROMPTS)], output_len) for i in range(n)]
    base = [dict(max_tokens=output_len, temperature=0.8 if i % 4 >= 2 else 0, seed=i) for i in range(n)]
    plain = [SamplingParams(ignore_eos=True, **b) for b in base]
    half = [
        SamplingParams(json_schema=SCHEMAS[names[i % len(names)]], **b) if i % 2 else p
        for i, (b, p) in enumerate(zip(base, plain))
    ]
    return requests, [plain, half]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`jaxserve bench structured`'s flags."""
    flags.engine_flags(p, compare=False)
    p.add_argument("--validate", type=flags.positive, metavar="N", help="check the outputs of N mixed requests instead")
    p.add_argument("--num-requests", type=flags.positive, default=64)
    p.add_argument("--output-len", type=flags.positive, default=48)
    p.add_argument(
        "--batch", type=flags.positive, default=16, help="requests in flight at once (max_slots; default 16)"
    )
    p.add_argument("--rounds", type=flags.positive, default=3)
    flags.out_flag(p)


def run(args, argv, build_llms) -> dict:
    """The subcommand; build_llms is commands._build_llms (one LLM here)."""
    from jaxserve.tools.bench.offline import run_offline

    opts = {"max_slots": args.batch, "max_model_len": 512, "token_buckets": [16, 32, 64], **args.engine_opts}
    with ExitStack() as stack:
        (llm,), (cfg,) = build_llms(args, stack, [opts])
        if args.validate:
            r = validate(llm, args.validate)
            r["compiles_since_warmup"] = llm.compiles_since_warmup()
            print(
                f"{r['constrained']} constrained outputs, {len(r['invalid'])} invalid; {r['unconstrained']} "
                f"unconstrained, {len(r['unconstrained_differ_from_alone'])} differ from their run alone; "
                f"{r['tokens']} tokens in {r['seconds']:.1f} s; compiles since warm-up {r['compiles_since_warmup']}",
                flush=True,
            )
            if r["invalid"] or r["unconstrained_differ_from_alone"]:
                raise ValueError(f"validate: {r['invalid'][:3]} {r['unconstrained_differ_from_alone'][:3]}")
            return result.document("structured", argv, workload={"validate": args.validate}, summary=r)
        requests, params = _throughput_requests(args.num_requests, args.output_len)
        llm.generate([r.prompt for r in requests[: args.batch]], params[1][: args.batch])  # grammars compiled
        configs = [ab.Config(name, {**cfg.spec, "constrained": name}) for name in ("unconstrained", "half-constrained")]
        run_round = lambda c, k: run_offline(llm, requests, max_concurrency=args.batch, params=params[c])  # noqa: E731
        results = ab.run_ab(configs, run_round, args.rounds)
    ab.print_medians(results)
    half = results[1]
    summary = {
        "throughput_ratio": half["ratio_vs_first"]["output_tok_s"],
        "grammar_mask_ms_per_step": half["rounds"][-1]["extra"].get("grammar_mask_ms_per_step"),
    }
    print(
        f"half constrained: {summary['throughput_ratio']:.2f}x the unconstrained output tok/s at batch {args.batch}; "
        f"grammar masks {summary['grammar_mask_ms_per_step'] or 0:.3f} ms per step",
        flush=True,
    )
    workload = {"num_requests": args.num_requests, "output_len": args.output_len, "batch": args.batch}
    return result.document("structured", argv, workload=workload, configs=results, summary=summary)
