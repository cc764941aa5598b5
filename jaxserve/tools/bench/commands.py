"""`jaxserve bench SUBCOMMAND`: the command line of the benchmark harness.

Each subcommand builds its configurations, runs them through the A/B runner (ab.py) with one
driver (offline.py: an LLM in this process; serve.py: an OpenAI-compatible server over HTTP),
prints a line per round and the medians, and writes the result JSON (result.py) with --out.
Bad arguments exit 2 with a usage message; a bad value found later (a workload file's field,
a model that does not load, a server that does not answer) exits 2 with
"jaxserve bench NAME: error: ...".
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

from jaxserve.tools.bench import ab, result
from jaxserve.tools.bench.flags import (
    engine_flags,
    json_object,
    out_flag,
    positive,
    rate,
    shape,
    workload_flags,
)
from jaxserve.tools.bench.workload import Workload, WorkloadSpec

SUBCOMMANDS = {
    "throughput": "offline LLM.generate-style throughput over a workload; A/B with --engine-opts",
    "latency": "batch-1 latency: prefill time (TTFT) and decode ms/token (TPOT)",
    "serve": "Poisson arrivals against OpenAI-compatible servers (/v1/completions, streaming)",
    "prefix": "prefix caching on against off, on prompts sharing a long prefix",
    "speculative": "speculative decoding (n-gram, a draft model) against plain decoding",
    "kernels": "attention kernels and projections timed beside their memory bound (a streaming read in the same run)",
    "structured": "structured output: a constrained batch's validity, or its throughput against unconstrained",
    "quality": "held-out loss and greedy agreement of engine options (quantization, KV dtype, attention) against the first",
    "startup": "a fresh process's time to its first token, with empty caches (cold) and filled ones (warm)",
    "profile": "one decode step under the JAX profiler: time per op and op kind (fusions, the native kernels)",
    "lm-eval": "lm-evaluation-harness against `jaxserve serve`, beside lm-eval's hf backend on the same checkpoint",
    "device": "the prepared accelerator run (probes, kernels, the engine on an 8B shape, torch), <= 8 min; "
    "--rehearse on the CPU",
}


# -- the parser -----------------------------------------------------------------------------------


def _span(r: tuple[int, int]) -> str:
    return str(r[0]) if r[0] == r[1] else f"{r[0]}-{r[1]}"


def _workload_spec(args, vocab: int, **over) -> WorkloadSpec:
    kind = "json" if args.workload_file else args.workload
    plen, olen = ((48, 256), (64, 160)) if kind == "long-short" else args.default_lengths
    fields = dict(
        kind=kind,
        num_requests=args.num_requests,
        prompt_len=args.prompt_len or plen,
        output_len=args.output_len or olen,
        prefix_len=args.prefix_len,
        num_groups=args.num_groups,
        long_fraction=args.long_fraction,
        long_len=args.long_len,
        path=args.workload_file,
        seed=args.seed,
        token_range=(3, vocab),
        temperature=args.temperature,
        top_p=args.top_p,
    )
    fields.update(over)
    return WorkloadSpec(**fields)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="jaxserve bench",
        description="Benchmark jaxserve (offline, or any OpenAI-compatible server). Every subcommand "
        "prints a line per round and the medians, and writes one JSON schema with --out.",
        epilog="`jaxserve bench NAME --help` shows a subcommand's flags. throughput, latency, prefix and "
        "speculative take --gin_file/--gin_param: the deployment's engine options are the base of "
        "every configuration. Docs: docs/benchmarks.md.",
    )
    sub = ap.add_subparsers(dest="name", metavar="SUBCOMMAND", required=True)
    for name, (add, run) in _parsers().items():
        p = sub.add_parser(name, help=SUBCOMMANDS[name], description=SUBCOMMANDS[name])
        add(p)
        p.set_defaults(run=run)
    return ap


def _parsers() -> dict:
    """{subcommand: (its flags, its command)}."""
    from jaxserve.tools.bench import device, lm_eval, profile, quality, startup, structured

    return {
        "throughput": (_add_throughput, cmd_throughput),
        "latency": (_add_latency, cmd_latency),
        "serve": (_add_serve, cmd_serve),
        "prefix": (_add_prefix, cmd_prefix),
        "speculative": (_add_speculative, cmd_speculative),
        "kernels": (_add_kernels, cmd_kernels),
        "structured": (structured.add_arguments, cmd_structured),
        "quality": (quality.add_arguments, cmd_quality),
        "startup": (startup.add_arguments, cmd_startup),
        "profile": (profile.add_arguments, cmd_profile),
        "lm-eval": (lm_eval.add_arguments, cmd_lm_eval),
        "device": (device.add_arguments, cmd_device),
    }


def _add_throughput(p: argparse.ArgumentParser) -> None:
    engine_flags(p)
    workload_flags(p, kind="random", n=64, plen="16-512", olen="16-256")
    p.add_argument("--random", type=shape, metavar="LAYERS,HIDDEN,VOCAB", help="a random Llama of that shape "
                   "instead of --model (needs torch), e.g. 32,128,32000")  # fmt: skip
    p.add_argument("--rate", type=rate, default=math.inf, help="requests/s, Poisson arrivals into the engine (bench "
                   "serve's schedule, without HTTP); inf (default): all at once")  # fmt: skip
    g = p.add_argument_group("engines in processes of their own (offline generate: throughput, no TTFT/ITL)")
    g.add_argument("--baseline-checkout", metavar="DIR", help="also jaxserve from this checkout (e.g. a git worktree "
                   "of the commit before) with the first --engine-opts")  # fmt: skip
    g.add_argument("--vllm-python", metavar="PY", help="the python of a venv with vLLM: adds vLLM configurations")
    g.add_argument(
        "--vllm-opts",
        action="append",
        type=json_object,
        default=[],
        metavar="JSON",
        help='vllm.LLM(...) options, e.g. \'{"dtype": "bfloat16"}\'; repeat it for several (default {})',
    )
    out_flag(p)


def _add_latency(p: argparse.ArgumentParser) -> None:
    engine_flags(p)
    workload_flags(p, kind="random", n=4, plen="512", olen="128")
    g = p.add_argument_group("host (--host: the engine thread's CPU time per decode step, by phase)")
    g.add_argument("--host", action="store_true", help="measure the host's work per decode step instead")
    g.add_argument("--rows", type=positive, default=64, help="--host: sequences decoding at once (64)")
    g.add_argument("--context", type=positive, default=64, help="--host: prompt tokens of each (64)")
    g.add_argument("--steps", type=positive, default=64, help="--host: decode steps timed a round (64)")
    g.add_argument(
        "--random",
        type=shape,
        metavar="LAYERS,HIDDEN,VOCAB",
        help="--host: a random Llama of that shape instead of --model (needs torch), e.g. 32,128,128256",
    )
    out_flag(p)


def _add_serve(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--base-url",
        action="append",
        required=True,
        metavar="URL",
        help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000; repeat it to compare servers",
    )
    p.add_argument(
        "--rate", type=rate, default=math.inf, help="requests/s, Poisson arrivals; inf (default): all at once"
    )
    p.add_argument("--api-key", default=None, help="bearer token for the servers")
    p.add_argument("--prompt-format", choices=("ids", "text"), default="ids", help="token-id lists or text of words")
    p.add_argument("--vocab-size", type=int, default=256, help="random token ids are drawn below this (default 256)")
    p.add_argument("--no-warmup", action="store_true", help="skip the one unmeasured request per server")
    p.add_argument(
        "--replica-metrics",
        action="append",
        default=[],
        metavar="URL,URL,...",
        help="the replicas behind a --base-url (a router), comma-separated, once per --base-url in the same order: "
        "their /metrics give each round's prefix-cache hit rate and requests per replica",
    )
    workload_flags(p, kind="random", n=64, plen="16-512", olen="16-256", rounds=1)
    out_flag(p)


def _add_prefix(p: argparse.ArgumentParser) -> None:
    engine_flags(p, compare=False)
    p.add_argument("--num-requests", type=positive, default=64)
    p.add_argument("--prefix-len", type=positive, default=1024, help="shared tokens (default 1024)")
    p.add_argument("--suffix-len", type=positive, default=32, help="unique tokens after the prefix (default 32)")
    p.add_argument("--output-len", type=positive, default=32)
    p.add_argument("--rounds", type=positive, default=2)
    p.add_argument("--seed", type=int, default=0)
    out_flag(p)


def _add_speculative(p: argparse.ArgumentParser) -> None:
    engine_flags(p, compare=False)
    p.add_argument("--draft", default=None, help="a draft checkpoint (same tokenizer); without it only n-gram runs")
    p.add_argument("--k", type=positive, default=4, help="draft tokens per step (default 4)")
    p.add_argument("--prompts", choices=("code", "editing", "edit", "chat"), default="editing", help="code: Python "
                   "source; editing: a function then the start of its copy (prompt lookup's case); edit: chat requests "
                   "to edit a snippet and show the whole code; chat: questions to an instruct model (edit and chat "
                   "rendered with its chat template)")  # fmt: skip
    p.add_argument("--fixed-k", type=positive, default=None, help="also run n-gram with every row proposing up to "
                   "this many drafts (speculative_adaptive=False)")  # fmt: skip
    p.add_argument("--num-requests", type=positive, default=8)
    p.add_argument("--output-len", type=positive, default=128)
    p.add_argument("--batch", type=positive, default=1, help="requests in flight at once (default 1)")
    p.add_argument("--rounds", type=positive, default=2)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None, help="generate "
                   "--output-len tokens past EOS (default: for code and editing, text without an end; chat and "
                   "edit answers end at EOS, --output-len at most)")  # fmt: skip
    out_flag(p)


def _add_kernels(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reps", type=positive, default=7, help="timed calls per cell (median; default 7)")
    p.add_argument("--rows", type=str, default="1,8,32", help="decode rows (comma list)")
    p.add_argument("--contexts", type=str, default="512,2048", help="context lengths (comma list)")
    p.add_argument("--head-dim", type=positive, default=None, help="default: 64 on the CPU, 128 elsewhere")
    p.add_argument("--heads", type=str, default="8/4", metavar="Q/KV", help="query/KV heads (default 8/4)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None, help="default: float32 on CPU, else bf16")
    p.add_argument(
        "--ragged-steps",
        default="16x1024+256,0x0+2048",
        metavar="RxC+T[@C],...",
        help="ragged steps: R decode rows at context C plus a T-token prompt chunk (fresh, or at context C "
        "after @); default 16x1024+256,0x0+2048",
    )
    p.add_argument(
        "--matmul",
        default="",
        metavar="KxN,...",
        help="projection shapes to time at --matmul-rows (e.g. the 56.4M Llama's 512x1024,512x512,512x2816,"
        "1408x512,512x32000); default none",
    )
    p.add_argument("--matmul-rows", default="1,32", help="rows of x for --matmul (comma list; default 1,32)")
    p.add_argument(
        "--moe",
        default="",
        metavar="ExHxF:K,...",
        help="mixture-of-experts layers to time at --moe-tokens: E experts of hidden H and width F, top-K "
        "(e.g. 32x512x256:4); default none",
    )
    p.add_argument("--moe-tokens", default="32,256", help="tokens per step for --moe (comma list; default 32,256)")
    p.add_argument(
        "--peak-tflops", type=float, default=None, help="the chip's peak TFLOP/s for --dtype: adds the FLOP bound"
    )
    out_flag(p)


# -- the LLMs of a run -----------------------------------------------------------------------------


def _base(args) -> tuple[str | None, dict]:
    """(model, base LLM options): gin's when gin flags are given, else (--model, {})."""
    if args.gin_file or args.gin_param:
        from jaxserve.serve_config import load_config

        cfg = load_config(args.gin_file, args.gin_param, {"model": args.model} if args.model else {})
        return cfg.model, cfg.engine_options()
    return args.model, {}


def _resolve_model(model: str | None, args, stack: ExitStack) -> str | None:
    if model is not None and model.endswith(".json"):  # a workload file: its `model`, any requests
        source = model
    elif model != "workload":
        return model
    elif not getattr(args, "workload_file", None):
        raise ValueError("model: 'workload' needs --workload-file with a `model` field")
    else:
        source = args.workload_file
    spec = json.loads(Path(source).read_text()).get("model")
    if not isinstance(spec, dict):
        raise ValueError(f"model: {source} has no `model` field to build")
    from jaxserve.tools.bench.workload import model_from_spec

    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="jaxserve-bench-")))
    print(f"building the workload's random model in {tmp}", flush=True)
    return str(model_from_spec(spec, tmp))


def _label(opts: dict) -> str:
    return json.dumps(opts, separators=(",", ":")) if opts else "defaults"


def _build_llms(args, stack: ExitStack, option_sets: list[dict]) -> tuple[list, list[ab.Config]]:
    """One LLM per option set (all alive at once: rounds alternate between them). Each holds its
    own KV pool: on an accelerator give each set its kv_cache_memory_bytes."""
    from jaxserve.llm import LLM
    from jaxserve.tools.bench.offline import engine_options

    model, base = _base(args)
    model = _resolve_model(model, args, stack)
    llms, configs = [], []
    for opts in option_sets:
        print(f"loading {model or 'the default model'} with {_label(opts)}", flush=True)
        llms.append(LLM(model, **engine_options({**base, **opts})))
        configs.append(ab.Config(_label(opts), {"model": model, "options": opts}))
    return llms, configs


def _offline_ab(args, llms, configs, rounds_of, *, max_concurrency=None, others=()) -> list[dict]:
    """Rounds alternating over the LLMs, then `others` (callables requests -> RoundStats: vLLM).
    With a finite --rate, round k's arrivals are bench serve's Poisson schedule of seed + k."""
    from jaxserve.tools.bench.offline import check_fits, run_offline
    from jaxserve.tools.bench.serve import arrival_gaps

    for llm in llms:
        check_fits(rounds_of(0), llm.max_model_len)
    cache: dict[int, list] = {}
    get = lambda k: cache.setdefault(k, rounds_of(k))  # noqa: E731
    rate = getattr(args, "rate", math.inf)

    def one(c: int, k: int):
        reqs = get(k)
        if c >= len(llms):
            return others[c - len(llms)](reqs)
        arrivals = None if math.isinf(rate) else arrival_gaps(len(reqs), rate, args.seed + k).cumsum().tolist()
        return run_offline(llms[c], reqs, max_concurrency=max_concurrency, arrivals=arrivals)

    return ab.run_ab(configs, one, args.rounds)


def _workers(args, stack: ExitStack, configs: list[ab.Config], text: bool) -> list:
    """A worker per --vllm-opts (vLLM's venv) and one for --baseline-checkout, on the checkpoint
    the jaxserve configurations load."""
    import sys

    from jaxserve.tools.bench.workers import Worker

    if not args.vllm_python and not args.baseline_checkout:
        return []
    model = configs[0].spec["model"]
    if model is None or not Path(model).exists():
        raise ValueError(f"model: a worker process needs --model as a path, got {model!r}")
    model, runners = str(Path(model).resolve()), []  # the worker runs in another directory
    sides = [("vllm", args.vllm_python, o, None) for o in (args.vllm_opts or [{}])] if args.vllm_python else []
    if args.baseline_checkout:
        base = configs[0].spec["options"]
        sides.append(("jaxserve", sys.executable, base, args.baseline_checkout))
    for kind, python, opts, checkout in sides:
        label = f"{kind} {_label(opts)}" if checkout is None else f"checkout {checkout} {_label(opts)}"
        print(f"starting {label} on {model}", flush=True)
        worker = Worker(python, kind, model, opts, text, checkout)
        stack.callback(worker.close)
        configs.append(ab.Config(label, {"model": model, "engine": kind, "options": opts, "checkout": checkout}))
        runners.append(worker.round)
    return runners


# -- subcommands -----------------------------------------------------------------------------------


def cmd_throughput(args, argv) -> dict:
    Workload.load(_workload_spec(args, 2**31 - 1))  # a bad workload fails before any model loads
    if args.vllm_python and not Path(args.vllm_python).is_file():
        raise ValueError(f"vllm_python: {args.vllm_python} is not a file (the python of a venv with vLLM)")
    if (args.vllm_python or args.baseline_checkout) and math.isfinite(args.rate):
        raise ValueError("rate: a worker's offline generate takes a round at once; compare arrivals with bench serve")
    with ExitStack() as stack:
        _random_model(args, stack)
        llms, configs = _build_llms(args, stack, args.engine_opts or [{}])
        wl = Workload.load(_workload_spec(args, llms[0].model_cfg.vocab_size))
        others = _workers(args, stack, configs, text=isinstance(wl.round(0)[0].prompt, str))
        results = _offline_ab(args, llms, configs, wl.round, others=others)
    ab.print_medians(results)
    return result.document("throughput", argv, workload=wl.describe(), configs=results)


def _random_model(args, stack: ExitStack) -> None:
    """--random LAYERS,HIDDEN,VOCAB: build that Llama (random weights) and make it --model."""
    from jaxserve.tools.bench import host

    if args.random:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="jaxserve-bench-")))
        print(f"building a random Llama {args.random} (layers, hidden, vocab) in {tmp}", flush=True)
        args.model = str(host.random_model(*args.random, tmp))


def cmd_host(args, argv) -> dict:
    """latency --host: configurations side by side, rounds alternating (tools/bench/host.py)."""
    from jaxserve.tools.bench import host

    with ExitStack() as stack:
        _random_model(args, stack)
        sized = {"max_slots": args.rows, "max_model_len": args.context + args.steps + 128}
        llms, configs = _build_llms(args, stack, [{**sized, **o} for o in args.engine_opts or [{}]])
        per: list[list[dict]] = [[] for _ in llms]
        for k in range(args.rounds):
            for c in ab.order(k, len(llms)):
                r = host.measure(llms[c], args.rows, args.context, args.steps, args.seed + k)
                r["device_ms"] = host.device_ms(llms[c], args.rows, args.context)
                per[c].append(r)
                print(host.line(configs[c].label, k, r), flush=True)
    results = []
    for cfg, rs in zip(configs, per):
        median = {m: statistics.median(r[m] for r in rs) for m in ("host_ms", "wall_ms", "device_ms")}
        median["phases_ms"] = {p: statistics.median(r["phases_ms"][p] for r in rs) for p in rs[0]["phases_ms"]}
        results.append({"label": cfg.label, "spec": cfg.spec, "rounds": rs, "median": median})
        print(
            f"{cfg.label}: median of {len(rs)} rounds: host {median['host_ms']:.3f} ms per decode step at "
            f"{args.rows} rows, wall {median['wall_ms']:.2f} ms, device {median['device_ms']:.2f} ms",
            flush=True,
        )
    workload = {"rows": args.rows, "context": args.context, "steps": args.steps, "random": args.random}
    return result.document("latency", argv, workload=workload, configs=results)


def cmd_latency(args, argv) -> dict:
    if args.host:
        return cmd_host(args, argv)
    Workload.load(_workload_spec(args, 2**31 - 1))  # a bad workload fails before any model loads
    with ExitStack() as stack:
        llms, configs = _build_llms(args, stack, args.engine_opts or [{}])
        wl = Workload.load(_workload_spec(args, llms[0].model_cfg.vocab_size))
        results = _offline_ab(args, llms, configs, wl.round, max_concurrency=1)
    summary = {}
    for r in results:
        m = r["median"]
        summary[r["label"]] = {"prefill_ms": 1e3 * m["ttft_p50_s"], "decode_ms_per_token": 1e3 * m["tpot_p50_s"]}
        print(
            f"{r['label']}: batch 1, prompt {_span(wl.spec.prompt_len)}, output {_span(wl.spec.output_len)}: "
            f"prefill (TTFT p50) "
            f"{summary[r['label']]['prefill_ms']:.1f} ms, decode {summary[r['label']]['decode_ms_per_token']:.2f} "
            f"ms/token (TPOT p50, medians of {args.rounds} rounds)",
            flush=True,
        )
    return result.document("latency", argv, workload=wl.describe(), configs=results, summary=summary)


def cmd_serve(args, argv) -> dict:
    from jaxserve.tools.bench import serve

    endpoints = [serve.discover(u, args.api_key) for u in args.base_url]
    for ep in endpoints:
        print(f"{ep.base_url}: model {ep.model!r}, max_model_len {ep.max_model_len}", flush=True)
    spec = _workload_spec(args, args.vocab_size, text=args.prompt_format == "text")
    wl = Workload.load(spec)
    if not args.no_warmup:
        for ep in endpoints:
            serve.warm_up(ep, "hello world" if spec.text else [3, 4, 5, 6])
    if args.replica_metrics and len(args.replica_metrics) != len(endpoints):
        raise ValueError(
            f"replica_metrics: give it once per --base-url ({len(endpoints)}), got {len(args.replica_metrics)}"
        )
    replicas = [[u for u in group.split(",") if u] for group in args.replica_metrics]
    configs = [ab.Config(ep.base_url, {"base_url": ep.base_url, "model": ep.model}) for ep in endpoints]
    for cfg, urls in zip(configs, replicas):
        cfg.spec["replicas"] = urls
    cache: dict[int, list] = {}

    def run_round(c: int, k: int):
        before = [serve.scrape_counters(u) for u in replicas[c]] if replicas else []
        stats = serve.run_serving(endpoints[c], cache.setdefault(k, wl.round(k)), args.rate, args.seed + k)
        if replicas:
            stats.extra["replicas"] = serve.replica_deltas(before, [serve.scrape_counters(u) for u in replicas[c]])
            r = stats.extra["replicas"]
            print(f"[{configs[c].label}] round {k}: prefix-cache hit rate {r['hit_rate']:.3f}, "
                  f"requests per replica {r['requests_per_replica']}", flush=True)  # fmt: skip
        return stats

    results = ab.run_ab(configs, run_round, args.rounds)
    ab.print_medians(results)
    if replicas:
        _replica_medians(results)
    return result.document("serve", argv, workload={**wl.describe(), "rate": args.rate}, configs=results)


def _replica_medians(results: list[dict]) -> None:
    """Each configuration's median prefix-cache hit rate over its rounds (and the ratio to the first)."""
    import statistics

    for r in results:
        r["median"]["prefix_cache_hit_rate"] = statistics.median(
            x["extra"]["replicas"]["hit_rate"] for x in r["rounds"]
        )
    first = results[0]["median"]["prefix_cache_hit_rate"]
    for r in results:
        rate = r["median"]["prefix_cache_hit_rate"]
        line = f"{r['label']}: median prefix-cache hit rate {rate:.3f}"
        if r is not results[0]:
            r["ratio_vs_first"]["prefix_cache_hit_rate"] = rate / first if first else float("nan")
            line += f" | vs {results[0]['label']}: {r['ratio_vs_first']['prefix_cache_hit_rate']:.3f}x"
        print(line, flush=True)


def cmd_prefix(args, argv) -> dict:
    from jaxserve.tools.bench.offline import run_offline

    opts = dict(args.engine_opts)
    opts.setdefault("max_model_len", args.prefix_len + args.suffix_len + args.output_len + 16)
    with ExitStack() as stack:
        sets = [{**opts, "enable_prefix_caching": True}, {**opts, "enable_prefix_caching": False}]
        llms, configs = _build_llms(args, stack, sets)
        configs[0].label, configs[1].label = "caching on", "caching off"
        spec = WorkloadSpec(
            kind="shared-prefix",
            num_requests=args.num_requests,
            prompt_len=(args.suffix_len, args.suffix_len),
            output_len=(args.output_len, args.output_len),
            prefix_len=args.prefix_len,
            seed=args.seed,
            token_range=(3, llms[0].model_cfg.vocab_size),
        )
        wl = Workload.load(spec)
        outputs: dict[tuple[int, int], list] = {}

        def one(c: int, k: int):
            rs = run_offline(llms[c], wl.round(k))
            outputs[(c, k)] = rs.outputs
            return rs

        results = ab.run_ab(configs, one, args.rounds)
    on, off = results[0]["median"], results[1]["median"]
    same = sum(a == b for k in range(args.rounds) for a, b in zip(outputs[(0, k)], outputs[(1, k)]))
    summary = {
        "ttft_p50_speedup": off["ttft_p50_s"] / on["ttft_p50_s"],
        "ttft_p99_speedup": off["ttft_p99_s"] / on["ttft_p99_s"],
        "throughput_speedup": on["output_tok_s"] / off["output_tok_s"],
        "identical_outputs": f"{same}/{args.num_requests * args.rounds}",
    }
    ab.print_medians(results)
    print(
        f"prefix caching: TTFT p50 {summary['ttft_p50_speedup']:.2f}x faster, p99 {summary['ttft_p99_speedup']:.2f}x; "
        f"throughput {summary['throughput_speedup']:.2f}x; identical greedy outputs {summary['identical_outputs']}",
        flush=True,
    )
    return result.document("prefix", argv, workload=wl.describe(), configs=results, summary=summary)


def cmd_speculative(args, argv) -> dict:
    from jaxserve.tools.bench import speculative
    from jaxserve.tools.bench.offline import run_offline
    from jaxserve.tools.bench.workload import Request

    base = {"enable_prefix_caching": False, **args.engine_opts}
    ngram = {**base, "speculative_model": "ngram", "num_speculative_tokens": args.k}
    sets, labels = [base, ngram], ["plain", "ngram"]
    if args.fixed_k:  # every row proposes up to k (speculative_adaptive=False), beside the adaptive choice
        sets.append({**ngram, "speculative_adaptive": False, "num_speculative_tokens": args.fixed_k})
        labels.append(f"ngram-fixed-k{args.fixed_k}")
    if args.draft:
        sets.append({**base, "speculative_model": args.draft, "num_speculative_tokens": args.k})
        labels.append("draft")
    prompts = speculative.prompts(args.prompts, args.num_requests)
    outputs: dict[tuple[int, int], list] = {}
    with ExitStack() as stack:
        llms, configs = _build_llms(args, stack, sets)
        if args.prompts in ("chat", "edit"):
            tok = llms[0].tokenizer
            prompts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in prompts]
        ignore_eos = args.ignore_eos if args.ignore_eos is not None else args.prompts in ("code", "editing")
        requests = [Request(p, args.output_len, until_eos=not ignore_eos) for p in prompts]
        for cfg, name in zip(configs, labels):
            cfg.label = name

        def one(c: int, k: int):
            rs = run_offline(llms[c], requests, max_concurrency=args.batch)
            outputs[(c, k)] = rs.outputs
            return rs

        results = ab.run_ab(configs, one, args.rounds)
    ab.print_medians(results)
    summary = {}
    for c, r in enumerate(results[1:], start=1):
        same = sum(a == b for k in range(args.rounds) for a, b in zip(outputs[(c, k)], outputs[(0, k)]))
        extra = r["rounds"][-1]["extra"]
        summary[r["label"]] = {
            "speedup": r["ratio_vs_first"]["output_tok_s"],
            "tokens_per_target_step": extra.get("spec_tokens_per_target_step"),
            "acceptance_by_position": extra.get("spec_acceptance_by_position"),
            "identical_outputs": f"{same}/{len(requests) * args.rounds}",
        }
        s = summary[r["label"]]
        print(
            f"{r['label']}: {s['speedup']:.2f}x plain's output tok/s at batch {args.batch}, "
            f"{s['tokens_per_target_step']:.2f} tokens per target step, acceptance by position "
            f"{[round(a, 2) for a in s['acceptance_by_position'] or []]}, identical outputs {s['identical_outputs']}",
            flush=True,
        )
    workload = {
        "kind": args.prompts,
        "num_requests": len(requests),
        "output_len": args.output_len,
        "ignore_eos": ignore_eos,
        "batch": args.batch,
    }
    return result.document("speculative", argv, workload=workload, configs=results, summary=summary)


def cmd_kernels(args, argv) -> dict:
    from jaxserve.tools.bench import kernels

    return kernels.run(args, argv)


def cmd_structured(args, argv) -> dict:
    from jaxserve.tools.bench import structured

    return structured.run(args, argv, _build_llms)


def cmd_quality(args, argv) -> dict:
    from jaxserve.tools.bench import quality

    return quality.run(args, argv, _build_llms)


def cmd_startup(args, argv) -> dict:
    from jaxserve.tools.bench import startup

    return startup.run(args, argv)


def cmd_profile(args, argv) -> dict:
    from jaxserve.tools.bench import profile

    return profile.run(args, argv)


def cmd_lm_eval(args, argv) -> dict:
    from jaxserve.tools.bench import lm_eval

    return lm_eval.run(args, argv)


def cmd_device(args, argv) -> dict:
    from jaxserve.tools.bench import device

    return device.run(args, argv)


# -- entry -----------------------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    ap = build_parser()
    if not argv:
        ap.print_usage(sys.stderr)
        print(f"{ap.prog}: error: a subcommand is required ({', '.join(SUBCOMMANDS)})", file=sys.stderr)
        return 2
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:  # --help: 0; bad arguments: argparse printed the usage, 2
        return int(e.code or 0)
    try:
        doc = args.run(args, argv)
    except (ValueError, FileNotFoundError) as e:
        print(f"jaxserve bench {args.name}: error: {e}", file=sys.stderr)
        return 2
    result.write(doc, args.out)
    return 0
