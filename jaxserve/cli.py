"""The `jaxserve` command: serve, generate, client, kv-math, bench, convert, k8s, options.

Every command takes gin configuration (see docs/deploy.md):

    jaxserve serve --gin_file jaxserve/configs/llama-3.1-8b-instruct.gin --gin_param "ServeConfig.max_slots = 32"

Precedence, lowest first: ServeConfig's defaults, the gin files in order (serve, generate and
convert read jaxserve/configs/default.gin when none is given), the --gin_param bindings in order,
then explicit flags (--max-slots ...). serve and generate log the effective configuration at
start. A bad flag, binding, file or value exits 2 with "jaxserve CMD: error: ...".
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable

from jaxserve.serve_config import options

log = logging.getLogger("jaxserve.cli")

GIN_HELP = (
    "gin configuration: --gin_file FILE (repeatable; a path, or relative to jaxserve/configs/, e.g. "
    "llama-3.1-8b-instruct.gin) and --gin_param 'ServeConfig.FIELD = VALUE' (repeatable). "
    "Explicit flags override both."
)


def _csv_ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _flag_type(hint) -> Callable[[str], Any] | None:
    """The argparse type of a field's annotation (None for a switch: bool)."""
    import types
    import typing

    args = [a for a in typing.get_args(hint) if a is not type(None)] if isinstance(hint, types.UnionType) else [hint]
    base = args[0]
    if base is bool:
        return None
    return _csv_ints if typing.get_origin(base) is tuple else base


def _flags(group: str, switches: bool) -> dict:
    """flag -> (ServeConfig field, type, help) of one group's options, from their declaration
    (serve_config.options); switches: the bool options (--X / --no-X) instead."""
    out = {}
    for o in options():
        if o.group != group or o.flag is None or o.name == "model" or (_flag_type(o.hint) is None) != switches:
            continue
        help_ = o.help + (f" ({' | '.join(o.choices)})" if o.choices else "")
        out[o.flag] = (o.name, _flag_type(o.hint), help_)
    return out


# flag -> (ServeConfig field, type, help); a flag left out takes its value from gin.
ENGINE_FLAGS = _flags("engine", switches=False)
ENGINE_SWITCHES = _flags("engine", switches=True)  # --prefix-caching / --no-prefix-caching, ...
SERVER_FLAGS = _flags("server", switches=False)


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def _gin_parent() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("gin configuration")
    g.add_argument(
        "--gin_file",
        "--gin-file",
        dest="gin_file",
        action="append",
        default=[],
        metavar="FILE",
        help="a gin file (repeatable, applied in order); a path, or relative to jaxserve/configs/",
    )
    g.add_argument(
        "--gin_param",
        "--gin-param",
        dest="gin_param",
        action="append",
        default=[],
        metavar="BINDING",
        help="a gin binding, e.g. 'ServeConfig.max_slots = 32' (repeatable, after the files)",
    )
    return p


def _add_flags(p: argparse.ArgumentParser, flags: dict, title: str) -> None:
    g = p.add_argument_group(title, "default: the gin configuration")
    for flag, (_, typ, help_) in flags.items():
        g.add_argument(flag, type=typ, default=None, help=help_)


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="checkpoint directory or GGUF file (default: gin's ServeConfig.model; None there = the default model)",
    )
    _add_flags(p, ENGINE_FLAGS, "engine")
    g = p.add_argument_group("engine switches")
    for flag, (_, _, help_) in ENGINE_SWITCHES.items():
        g.add_argument(flag, dest=_dest(flag), action=argparse.BooleanOptionalAction, default=None, help=help_)
    g.add_argument("--no-compilation-cache", action="store_true", help="do not use a persistent compilation cache")


def _overrides(args, flags: dict) -> dict:
    """ServeConfig fields set by explicit flags (a flag left out is None and does not override)."""
    out = {field: getattr(args, _dest(flag)) for flag, (field, _, _) in flags.items()}
    out = {k: v for k, v in out.items() if v is not None}
    if getattr(args, "model", None) is not None:
        out["model"] = args.model
    for flag, (field, _, _) in ENGINE_SWITCHES.items():
        if getattr(args, _dest(flag), None) is not None:
            out[field] = getattr(args, _dest(flag))
    if getattr(args, "no_compilation_cache", False):
        out["compilation_cache_dir"] = None
    if getattr(args, "no_grpc", False):
        out["port"] = None
    return out


def _gin_files(args, default: bool = True) -> list[str]:
    from jaxserve.serve_config import DEFAULT_GIN_FILE

    return list(args.gin_file) or ([str(DEFAULT_GIN_FILE)] if default else [])


def load_cli_config(args, flags: dict | None = None, default_gin: bool = True):
    """The ServeConfig of a command: gin files, then --gin_param, then explicit flags."""
    from jaxserve.serve_config import load_config

    return load_config(_gin_files(args, default_gin), args.gin_param, _overrides(args, flags or {}))


def _log_effective_config(args, cfg, overrides: dict) -> None:
    from jaxserve.serve_config import operative_config_str

    log.info(
        "effective configuration (gin files: %s; gin params: %s; flags: %s):\n%s",
        ", ".join(_gin_files(args)) or "none",
        "; ".join(args.gin_param) or "none",
        ", ".join(f"{k}={v!r}" for k, v in overrides.items()) or "none",
        operative_config_str().rstrip(),
    )


def enable_compilation_cache(cache_dir: str | None) -> str | None:
    """Point JAX's persistent compilation cache at cache_dir (every entry is kept). Must run before
    the first compile. `serve` and `generate` use it only with several processes: in one process
    the engine's executable store (jaxserve/executable_cache.py) keeps the compiled steps."""
    if not cache_dir:
        return None
    import jax

    path = Path(cache_dir).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        log.warning("compilation cache disabled: cannot create %s (%s)", path, e)
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    log.info("XLA compilation cache: %s", path)
    return str(path)


def _build_llm(args, flags: dict, cfg=None):
    """The LLM of `serve` and `generate`. With JAXSERVE_COORDINATOR set (or in a LeaderWorkerSet
    group of several pods: multihost.coordinator_from_env), this process first joins the others
    (jax.distributed); only process 0 goes on to serve, the others replay its engine
    calls inside LLM() and return when it shuts down (`LLM.is_follower`)."""
    cfg = cfg if cfg is not None else load_cli_config(args, flags)
    _log_effective_config(args, cfg, _overrides(args, flags))
    from jaxserve.parallel import multihost

    if multihost.initialize():
        # The engine's executable store is per process; across processes JAX's cache does it.
        enable_compilation_cache(cfg.compilation_cache_dir)
    # In one process JAX's persistent cache stays off: the executable store in the same
    # directory holds every step, and must not be fed executables restored from JAX's cache
    # (XLA:CPU re-serializes those without all their functions).
    from jaxserve.llm import LLM

    return cfg, LLM(cfg.model, log_progress=True, **cfg.engine_options())


def _read_file(flag: str, path: str | None) -> bytes | None:
    """The bytes of a file a flag names; ValueError naming the flag (exit 2) when unreadable."""
    if path is None:
        return None
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {path!r}: {e.strerror or e}") from None


def cmd_serve(args) -> int:
    """Exit code: 0 after a drained SIGTERM/SIGINT, non-zero when the engine failed (a
    supervisor restarts the process)."""
    from jaxserve.serving.server import serve

    flags = {**ENGINE_FLAGS, **SERVER_FLAGS}
    cfg = load_cli_config(args, flags)

    def files() -> tuple[bytes | None, bytes | None, str | None]:
        token = args.token or (_read_file("--token-file", cfg.token_file).decode().strip() if cfg.token_file else None)
        return _read_file("--tls-cert", cfg.tls_cert), _read_file("--tls-key", cfg.tls_key), token

    # The files first, so that a bad path exits 2 before minutes of loading and warm-up. With
    # several processes only the serving one (known after they join) needs them: it reads them
    # then, inside the try, so that the others are released either way.
    from jaxserve.parallel.multihost import coordinator_from_env

    read = None if coordinator_from_env(os.environ)[0] else files()
    cfg, llm = _build_llm(args, flags, cfg)
    if llm.is_follower:
        return 0
    try:
        tls_cert, tls_key, token = read or files()
        return serve(llm.core, token=token, tls_cert=tls_cert, tls_key=tls_key, **cfg.server_options())
    finally:
        llm.shutdown()  # release the other processes


def _token_values(text: str) -> tuple[str, float]:
    key, _, value = text.partition("=")
    try:
        return key, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID=BIAS, got {text!r}") from None


def _add_sampling_flags(p: argparse.ArgumentParser, title: str) -> None:
    """A flag per field of the shared sampling model (engine/sampling_request.py), with its
    description as help: --temperature, --min-p, --stop (repeatable), --logit-bias TOKEN=BIAS
    (repeatable), --ignore-eos/--no-ignore-eos, ... A flag left out is the engine's default."""
    import types
    import typing

    from jaxserve.engine.sampling_request import SamplingFields

    g = p.add_argument_group(title)
    for name, field in SamplingFields.model_fields.items():
        flag, help_ = "--" + name.replace("_", "-"), field.description
        args = [a for a in typing.get_args(field.annotation) if a is not type(None)]
        base = args[-1] if isinstance(field.annotation, types.UnionType) else field.annotation
        origin = typing.get_origin(base)
        if base is bool:
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_)
        elif origin is dict:
            g.add_argument(flag, type=_token_values, action="append", default=None, metavar="TOKEN=BIAS", help=help_)
        elif origin is list:
            g.add_argument(flag, type=typing.get_args(base)[0], action="append", default=None, help=help_)
        else:
            g.add_argument(flag, type=base, default=None, help=help_)


def _sampling_fields(args):
    """The shared sampling model from the flags _add_sampling_flags made (those given)."""
    from jaxserve.engine.sampling_request import SamplingFields

    values = {name: getattr(args, name) for name in SamplingFields.model_fields}
    if values["logit_bias"] is not None:
        values["logit_bias"] = dict(values["logit_bias"])
    return SamplingFields.parse({k: v for k, v in values.items() if v is not None})


def _generate_params(args):
    """The SamplingParams of `jaxserve generate`, checked before any model loads."""
    from jaxserve.engine.sampling_request import to_sampling_params

    constraint = {}
    if args.json_schema is not None:
        constraint["json_schema"] = Path(args.json_schema).read_text()
    if args.grammar is not None:
        constraint["grammar"] = Path(args.grammar).read_text()
    if args.regex is not None:
        constraint["regex"] = args.regex
    if args.json_object:
        constraint["json_object"] = True
    fields = _sampling_fields(args)
    return to_sampling_params(fields, max_tokens=fields.max_tokens, default_max=0, max_model_len=0, **constraint)(0)


def cmd_generate(args) -> int:
    params = _generate_params(args)
    _, llm = _build_llm(args, ENGINE_FLAGS)
    if llm.is_follower:
        return 0
    try:
        for prompt in args.prompt:
            if args.chat:  # one user turn, rendered by the model's chat template; the reply alone is printed
                from jaxserve.engine.chat import Conversation

                prompt = Conversation.of([{"role": "user", "content": prompt}])
            if params.n == 1:
                print("" if args.chat else prompt, end="", flush=True)
                for out in llm.stream(prompt, params):
                    print(out.text, end="", flush=True)
                print()
                continue
            for out in llm.generate([prompt], params):  # n completions, one after the other
                print(f"[{out.index}] {'' if args.chat else prompt}{out.text}")
    finally:
        llm.shutdown()
    return 0


def _client_target(host: str, port: int) -> str:
    host = {"0.0.0.0": "127.0.0.1", "::": "[::1]", "": "127.0.0.1"}.get(host, host)
    return f"{host}:{port}"


def cmd_client(args) -> int:
    from jaxserve.serving.client import Client

    target, token = args.target, args.token
    if args.gin_file or args.gin_param:  # gin gives the server's address and token file
        cfg = load_cli_config(args, default_gin=False)
        target = target or _client_target(cfg.host, cfg.port)
        if token is None and cfg.token_file:
            token = Path(cfg.token_file).read_text().strip()
    c = Client(target or "127.0.0.1:50051", token=token)
    sampling = _sampling_fields(args).model_dump(exclude_none=True)
    prompt = args.prompt
    if args.chat:  # one user turn (after an optional system message), rendered by the server's template
        prompt = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
    elif args.echo:
        print(args.prompt, end="", flush=True)
    last = None
    for r in c.generate(prompt, timeout=args.timeout, **sampling):
        print(r.text, end="", flush=True)
        last = r
    print()
    if last is not None and args.usage:
        u = last.usage
        print(
            f"[{last.finish_reason and 'finish=' + ['', 'stop', 'length', 'abort'][last.finish_reason]}; "
            f"prompt {u.prompt_tokens}, completion {u.completion_tokens}, cached {u.cached_prompt_tokens}]",
            file=sys.stderr,
        )
    return 0


_KV_DTYPES = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}


def kv_math_args_from_config(cfg) -> list[str]:
    """kv-math flags for a ServeConfig: the checkpoint (or its shape preset), chips, page size,
    context, dtypes, memory fraction. Put them before the user's flags so those win."""
    from jaxserve.models import gguf

    if cfg.model_path.is_dir() or (cfg.model_path.is_file() and gguf.is_gguf(cfg.model_path)):
        model = str(cfg.model_path)
    elif cfg.kv_math_preset:
        model = cfg.kv_math_preset
    else:
        raise ValueError(
            f"ServeConfig.model {str(cfg.model_path)!r} is not on this machine and "
            "ServeConfig.kv_math_preset is not set; pass --model"
        )
    out = [
        "--model",
        model,
        "--chips",
        str(cfg.tensor_parallel_size),
        "--page-size",
        str(cfg.page_size),
        "--memory-fraction",
        str(cfg.memory_fraction),
    ]
    if cfg.max_model_len is not None:
        out += ["--context", str(cfg.max_model_len)]
    if cfg.dtype in _KV_DTYPES:
        out += ["--kv-dtype", _KV_DTYPES[cfg.dtype], "--weight-dtype", _KV_DTYPES[cfg.dtype]]
    if cfg.kv_cache_dtype in ("int8", "fp8"):
        out += ["--kv-dtype", cfg.kv_cache_dtype]  # after the dtype's: argparse keeps the last
    if cfg.quantization == "int8":
        out += ["--weight-dtype", "int8"]
    return out


def _split_gin(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False, parents=[_gin_parent()])
    return p.parse_known_args(argv)


def cmd_kv_math(argv) -> int:
    from jaxserve.tools import kv_math_cli as kv_math

    gin_args, rest = _split_gin(argv)
    if "-h" in rest or "--help" in rest:
        kv_math._parser().print_help()  # noqa: SLF001
        print(
            f"\n{GIN_HELP}\nFrom gin: ServeConfig.model (or kv_math_preset when the checkpoint is not local) -> "
            "--model, tensor_parallel_size -> --chips, page_size, max_model_len -> --context, dtype -> "
            "--kv-dtype/--weight-dtype, memory_fraction."
        )
        return 0
    if gin_args.gin_file or gin_args.gin_param:
        try:
            cfg = load_cli_config(gin_args, default_gin=False)
            rest = kv_math_args_from_config(cfg) + rest
        except ValueError as e:
            print(f"jaxserve kv-math: error: {e}", file=sys.stderr)
            return 2
    return kv_math.main(rest)


def cmd_convert(args) -> int:
    import time

    from jaxserve.models.loader import load_model

    cfg = load_cli_config(args, {"--dtype": ("dtype", str, "")})
    t0 = time.perf_counter()
    load_model(cfg.model_path, dtype=cfg.dtype, cache_dir=args.cache_dir, quantization=cfg.quantization)
    print(f"converted {cfg.model_path} in {time.perf_counter() - t0:.1f}s")
    return 0


def cmd_bench(argv) -> int:
    """The benchmark harness (jaxserve/tools/bench): its own subcommands and flags."""
    from jaxserve.tools.bench.commands import main

    return main(argv)


def cmd_k8s(argv) -> int:
    """Kubernetes manifests (jaxserve/tools/k8s.py): its own subcommand and flags."""
    from jaxserve.tools.k8s import main

    return main(argv)


def cmd_options(args) -> int:
    """Every option: docs/options.md's Markdown, or one line each."""
    from jaxserve.serve_config import options_markdown

    if args.markdown:
        print(options_markdown(), end="")
        return 0
    for o in options():
        flag = f" ({o.flag})" if o.flag else ""
        print(f"ServeConfig.{o.name}{flag} = {o.default!r}: {o.help}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    gin_parent = _gin_parent()
    ap = argparse.ArgumentParser(prog="jaxserve", description="A JAX/XLA inference server for LLMs.", epilog=GIN_HELP)
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser(
        "serve",
        help="serve a model over gRPC (and the OpenAI-compatible HTTP API with --http-port)",
        parents=[gin_parent],
        description="Load a model, compile every shape, serve gRPC (Generate, Abort, GetModelInfo, "
        "health, reflection) and, with --http-port, the OpenAI-compatible HTTP API (/v1/models, "
        "/v1/completions, /v1/chat/completions, /health, /tokenize, /detokenize, /tokenizer_info, /metrics) from the same engine. Prints 'jaxserve: serving "
        "on HOST:PORT' once listening (and 'jaxserve: OpenAI-compatible HTTP on http://HOST:PORT/v1').",
        epilog=GIN_HELP + " Without --gin_file: jaxserve/configs/default.gin.",
    )
    _add_engine_flags(p)
    _add_flags(p, SERVER_FLAGS, "server")
    p.add_argument("--token", default=None, help="require this bearer token (prefer --token-file)")
    p.add_argument("--no-grpc", action="store_true", help="serve the HTTP API only (needs --http-port)")
    p.set_defaults(fn=cmd_serve)
    p = sub.add_parser(
        "generate",
        help="generate offline, no server",
        parents=[gin_parent],
        description="Load a model and complete each PROMPT on stdout.",
        epilog=GIN_HELP + " Without --gin_file: jaxserve/configs/default.gin.",
    )
    _add_engine_flags(p)
    p.add_argument("prompt", nargs="+")
    p.add_argument("--chat", action="store_true", help="send each PROMPT as a user message (the model's chat template)")
    _add_sampling_flags(p, "sampling (docs/sampling.md; default: the engine's, greedy, 64 tokens)")
    p.set_defaults(max_tokens=64, temperature=0.0)
    g = p.add_argument_group("constrained output (docs/sampling.md)")
    one = g.add_mutually_exclusive_group()
    one.add_argument("--json-schema", metavar="FILE", help="the output is JSON valid under this JSON Schema file")
    one.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    one.add_argument("--regex", help="the output matches this regular expression")
    one.add_argument("--grammar", metavar="FILE", help="the output matches this Lark (or GBNF) grammar file")
    p.set_defaults(fn=cmd_generate)
    p = sub.add_parser(
        "client",
        help="stream a generation from a running server",
        parents=[gin_parent],
        description="Stream one generation from a running server.",
        epilog=GIN_HELP + " With gin flags, the target is the configuration's host:port and the "
        "token is read from its token_file.",
    )
    p.add_argument("prompt")
    p.add_argument("--target", default=None, help="HOST:PORT (default 127.0.0.1:50051, or gin's host:port)")
    p.add_argument("--token", default=None)
    _add_sampling_flags(p, "sampling (default: the server's, greedy, 64 tokens)")
    p.set_defaults(max_tokens=64, temperature=0.0)
    p.add_argument("--timeout", type=float, default=None)
    p.add_argument("--echo", action="store_true", help="print the prompt first")
    p.add_argument("--chat", action="store_true", help="send PROMPT as a user message (the server's chat template)")
    p.add_argument("--system", default=None, help="with --chat: a system message before it")
    p.add_argument("--usage", action="store_true", help="print token counts at the end")
    p.set_defaults(fn=cmd_client)
    sub.add_parser(
        "kv-math", help="KV-cache capacity and cost calculator (see jaxserve kv-math --help)", add_help=False
    )
    sub.add_parser(
        "bench",
        help="benchmarks: jaxserve bench {throughput,latency,serve,prefix,speculative,kernels} [args]",
        add_help=False,
    )
    sub.add_parser(
        "k8s",
        help="Kubernetes manifests: jaxserve k8s render --kind {deployment,lws,inferencepool,router}",
        add_help=False,
    )
    p = sub.add_parser(
        "convert",
        help="convert a Hugging Face checkpoint into the converted-weight cache",
        parents=[gin_parent],
        epilog=GIN_HELP + " Without --gin_file: jaxserve/configs/default.gin.",
    )
    p.add_argument("--model", default=None, help="checkpoint directory or GGUF file (default: gin's ServeConfig.model)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--cache-dir", default=None)
    p.set_defaults(fn=cmd_convert)
    p = sub.add_parser("options", help="list every option (gin field, flag, default, help)")
    p.add_argument("--markdown", action="store_true", help="print docs/options.md")
    p.set_defaults(fn=cmd_options)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if argv and argv[0] == "kv-math":
        return cmd_kv_math(argv[1:])
    if argv and argv[0] == "bench":
        return cmd_bench(argv[1:])
    if argv and argv[0] == "k8s":
        return cmd_k8s(argv[1:])
    ap = build_parser()
    args, extra = ap.parse_known_args(argv)
    if extra:  # name the command in the message: "jaxserve serve: error: unrecognized arguments"
        sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
        (sub.choices[args.command] if args.command else ap).error(f"unrecognized arguments: {' '.join(extra)}")
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
