"""The `jaxserve` command: serve, generate, client, kv-math, bench, convert."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

ENGINE_FLAGS = {  # flag -> (EngineConfig field, type)
    "--max-slots": ("max_slots", int), "--page-size": ("page_size", int), "--max-model-len": ("max_model_len", int),
    "--num-pages": ("num_pages", int), "--dtype": ("dtype", str), "--attention-impl": ("attention_impl", str),
    "--max-prefill-tokens": ("max_prefill_tokens", int),
}


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory (default: the shipped model)")
    for flag, (_, typ) in ENGINE_FLAGS.items():
        p.add_argument(flag, type=typ, default=None)
    p.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    p.add_argument("--speculative-model", default=None, help='a draft checkpoint directory, or "ngram"')
    p.add_argument("--num-speculative-tokens", type=int, default=None)


def _engine_options(args) -> dict:
    opts = {field: getattr(args, flag[2:].replace("-", "_")) for flag, (field, _) in ENGINE_FLAGS.items()}
    opts = {k: v for k, v in opts.items() if v is not None}
    if args.no_prefix_caching:
        opts["enable_prefix_caching"] = False
    if args.speculative_model:
        opts["speculative_model"] = args.speculative_model
    if args.num_speculative_tokens is not None:
        opts["num_speculative_tokens"] = args.num_speculative_tokens
    return opts


def _build_llm(args):
    from jaxserve.llm import LLM

    return LLM(args.model, log_progress=True, **_engine_options(args))


def cmd_serve(args) -> int:
    from jaxserve.server import serve

    llm = _build_llm(args)
    tls = (Path(args.tls_cert).read_bytes(), Path(args.tls_key).read_bytes()) if args.tls_cert else (None, None)
    token = Path(args.token_file).read_text().strip() if args.token_file else args.token
    serve(llm, host=args.host, port=args.port, metrics_port=args.metrics_port, token=token, tls_cert=tls[0],
          tls_key=tls[1], max_waiting=args.max_waiting, grace_s=args.grace)
    return 0


def cmd_generate(args) -> int:
    from jaxserve.request import SamplingParams

    llm = _build_llm(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed)
    for prompt in args.prompt:
        print(prompt, end="", flush=True)
        for out in llm.stream(prompt, params):
            print(out.text, end="", flush=True)
        print()
    return 0


def cmd_client(args) -> int:
    from jaxserve.client import Client

    c = Client(args.target, token=args.token)
    sampling = dict(max_tokens=args.max_tokens, temperature=args.temperature)
    if args.seed is not None:
        sampling["seed"] = args.seed
    if args.echo:
        print(args.prompt, end="", flush=True)
    last = None
    for r in c.generate(args.prompt, timeout=args.timeout, **sampling):
        print(r.text, end="", flush=True)
        last = r
    print()
    if last is not None and args.usage:
        u = last.usage
        print(f"[{last.finish_reason and 'finish=' + ['', 'stop', 'length', 'abort'][last.finish_reason]}; "
              f"prompt {u.prompt_tokens}, completion {u.completion_tokens}, cached {u.cached_prompt_tokens}]",
              file=sys.stderr)
    return 0


def cmd_kv_math(argv) -> int:
    from jaxserve import kv_math

    return kv_math.main(argv)


def cmd_convert(args) -> int:
    import time

    from jaxserve.models.loader import load_model

    t0 = time.perf_counter()
    load_model(args.model, dtype=args.dtype, cache_dir=args.cache_dir)
    print(f"converted {args.model} in {time.perf_counter() - t0:.1f}s")
    return 0


def cmd_bench(argv) -> int:
    import runpy

    scripts = Path(__file__).resolve().parents[1] / "scripts"
    name = argv[0] if argv else "offline"
    path = scripts / f"bench_{name}.py"
    if not path.is_file():
        print(f"jaxserve bench: no benchmark {name!r} (have: "
              f"{', '.join(sorted(p.stem[6:] for p in scripts.glob('bench_*.py')))})", file=sys.stderr)
        return 2
    sys.argv = [str(path)] + argv[1:]
    runpy.run_path(str(path), run_name="__main__")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="jaxserve", description="A JAX/XLA inference server for LLMs.")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("serve", help="serve a model over gRPC")
    _add_engine_flags(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051, help="0 picks a free port (printed at start)")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus endpoint port")
    p.add_argument("--token", default=None, help="require this bearer token")
    p.add_argument("--token-file", default=None)
    p.add_argument("--tls-cert", default=None)
    p.add_argument("--tls-key", default=None)
    p.add_argument("--max-waiting", type=int, default=256)
    p.add_argument("--grace", type=float, default=30.0, help="seconds SIGTERM waits for in-flight requests")
    p.set_defaults(fn=cmd_serve)
    p = sub.add_parser("generate", help="generate offline, no server")
    _add_engine_flags(p)
    p.add_argument("prompt", nargs="+")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(fn=cmd_generate)
    p = sub.add_parser("client", help="stream a generation from a running server")
    p.add_argument("prompt")
    p.add_argument("--target", default="127.0.0.1:50051")
    p.add_argument("--token", default=None)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--timeout", type=float, default=None)
    p.add_argument("--echo", action="store_true", help="print the prompt first")
    p.add_argument("--usage", action="store_true", help="print token counts at the end")
    p.set_defaults(fn=cmd_client)
    sub.add_parser("kv-math", help="KV-cache capacity and cost calculator (see jaxserve kv-math --help)",
                   add_help=False)
    sub.add_parser("bench", help="run a benchmark: jaxserve bench {offline,prefix,serving,...} [args]",
                   add_help=False)
    p = sub.add_parser("convert", help="convert a Hugging Face checkpoint into the converted-weight cache")
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default=None)
    p.add_argument("--cache-dir", default=None)
    p.set_defaults(fn=cmd_convert)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if argv and argv[0] == "kv-math":
        return cmd_kv_math(argv[1:])
    if argv and argv[0] == "bench":
        return cmd_bench(argv[1:])
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.command is None:
        ap.print_help(sys.stderr)
        return 2
    try:
        return args.fn(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"jaxserve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
