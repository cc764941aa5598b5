"""EngineConfig: what one engine is built with, and the one declaration of every engine option.

Each field carries its help text, its allowed values and its bounds (`option(...)`); the
`jaxserve serve/generate` flags (cli.py), the gin `ServeConfig` fields (serve_config.py), the
option table in docs/options.md (`jaxserve options --markdown`) and the validation below are
all generated from it, so a new option is one field here. Plain Python (no jax), so the gin
layer and the CLI can validate a deployment without loading weights or touching a device.
The runner takes the fields it needs resolved for the backend (`runner_config.resolve`).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, Callable, Iterable

from pydantic import ConfigDict, TypeAdapter, ValidationError


def option(
    default: Any,
    help: str,
    *,
    choices: Iterable[str] | Callable[[], Iterable[str]] | None = None,
    minimum: int | None = None,
    check: Callable[[Any], str | None] | None = None,
    flag: str | None = None,
    cli: bool = True,
) -> Any:
    """A field of EngineConfig with what a user needs to know: `help` (one line: the flag's help
    and the docs table's), `choices` (the allowed strings, or a function giving them; None is
    allowed where it is the default), `minimum` (for counts; None allowed), `check` (value ->
    the error's tail, or None when fine), `flag` (the command-line name; default --NAME with
    dashes), `cli` (False: gin only, e.g. where the name would clash with a sampling flag)."""
    meta = dict(help=help, choices=choices, minimum=minimum, check=check, flag=flag, cli=cli)
    return dataclasses.field(default=default, metadata=meta)


def _fraction(v: float) -> str | None:
    return None if 0 < v <= 1 else "must be in (0, 1]"


def _increasing(v: tuple[int, ...] | None) -> str | None:
    if v is None or (v and list(v) == sorted(set(v)) and v[0] >= 1):
        return None
    return "must be increasing positive sizes"


def _tool_parsers() -> tuple[str, ...]:
    from jaxserve.engine.tool_calls import PARSERS

    return tuple(PARSERS)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_slots: int = option(16, "concurrent sequences (the decode batch)", minimum=1)
    page_size: int = option(16, "tokens per KV page", minimum=1)
    max_model_len: int | None = option(
        None, "longest prompt + output (default: the model's context, capped at 2048)", minimum=1
    )
    num_pages: int | None = option(None, "KV pages (default: sized from kv_cache_memory_bytes)", minimum=1)
    kv_cache_memory_bytes: int | None = option(
        None, "KV cache budget in bytes (default: accelerator memory left, or 2 GiB on the CPU)", minimum=1
    )
    memory_fraction: float = option(0.9, "share of accelerator memory to use", check=_fraction)
    # The token budget of one step (decode rows first, then prompt chunks): default 256 on the
    # CPU, 512 elsewhere. The step is padded to a token bucket: powers of two from 16 up to the
    # budget (on the CPU 1 and 8 too), or `token_buckets` as given (the last is the budget).
    max_num_batched_tokens: int | None = option(
        None, "token budget of one step: decode rows, then prompt chunks (default: 256 on the CPU, else 512)", minimum=1
    )
    token_buckets: tuple[int, ...] | None = option(
        None, "a step's padded token counts, compiled at warm-up, e.g. 16,32,64", check=_increasing
    )
    # The prompt tokens one step may carry while any sequence is decoding (None: the whole
    # budget). A streaming client's inter-token gap is the step's time, and on a CPU every prompt
    # token in a step costs compute: a small value keeps each step near a decode step's time
    # (`jaxserve serve` sets 64 on the CPU: docs/serving.md, "Inter-token latency").
    max_prefill_tokens_while_decoding: int | None = option(
        None, "prompt tokens a step may carry while sequences decode (bounds the inter-token gap)", minimum=1
    )
    dtype: str | None = option(None, "activations and weights (default: by backend)", choices=("float32", "bfloat16"))
    quantization: str | None = option(
        None, "int8: weight-only int8 projections, per-output-channel scales", choices=("int8",)
    )
    # "auto": pages in dtype; bfloat16 on a CPU that computes in bfloat16 by default.
    kv_cache_dtype: str = option(
        "auto",
        "KV pages; int8 and fp8 are 8-bit pages with per-token-per-head scales",
        choices=("auto", "float32", "bfloat16", "int8", "fp8"),
    )
    attention_impl: str | None = option(
        None,
        "attention kernel (default: pallas on TPU/GPU, native on the CPU; cudnn / tokamax: fresh "
        "prompts through cuDNN's / tokamax's fused attention on a GPU, the rest through pallas)",
        choices=("xla", "pallas", "native", "cudnn", "tokamax"),
    )
    # native: weights packed into panels, streamed by the C++ kernel.
    matmul_impl: str | None = option(
        None,
        "the projections' matmul (default: native on the CPU where the kernel is built)",
        choices=("xla", "native"),
    )
    # bfloat16: AMX tiles or AVX512-BF16, half the bytes a decode step reads; activations, norms
    # and attention's arithmetic stay float32, and the KV pages follow to bfloat16 unless
    # kv_cache_dtype says otherwise. float32: the exact float32 path.
    matmul_dtype: str | None = option(
        None,
        "native matmul weights (default: bfloat16 with AMX or AVX512-BF16 when dtype is not given)",
        choices=("float32", "bfloat16"),
    )
    interpret: bool | None = option(None, "run Pallas kernels interpreted (default: on the CPU)")
    enable_prefix_caching: bool = option(True, "reuse KV pages of shared prompt prefixes", flag="--prefix-caching")
    speculative_model: str | None = option(None, 'speculative decoding: a draft checkpoint directory, or "ngram"')
    num_speculative_tokens: int = option(4, "draft tokens per step")
    # A step with more decoding sequences than this runs as a plain step (vLLM's option of the same
    # name): verifying k + 1 tokens a sequence pays where a step is memory-bound, and loses where
    # its rows make it compute-bound. On the CPU 16 // (k + 1) (a CPU step turns compute-bound at
    # about 16 rows: 4 sequences at k = 3), elsewhere None (always speculate).
    speculative_disable_by_batch_size: int | None = option(
        None, "steps with more decoding sequences run plain (default: 16 // (k + 1) on the CPU)", minimum=1
    )
    # Prompt lookup ("ngram", vLLM's options of the same names): drafts follow the most recent
    # earlier occurrence of the longest suffix of prompt_lookup_max down to prompt_lookup_min
    # tokens. A longer minimum proposes less often and is right more often (a 1-token match
    # in chat is a poor guess, and a verify row costs more than a decode row on a CPU). On the
    # default model 2 proposed in half the code steps instead of 77%, for 2.13 tokens a step
    # instead of 2.29, and served code 1.53x plain against 1.44x.
    prompt_lookup_min: int = option(2, "prompt lookup: the shortest suffix matched", minimum=1)
    # Per request, from 0 drafts (a plain, overlapped step) to num_speculative_tokens, by that
    # request's measured acceptance and the step times measured on this host (engine/spec_policy.py).
    speculative_adaptive: bool = option(True, "prompt lookup chooses each request's drafts a step (off: always k)")
    prompt_lookup_max: int = option(3, "prompt lookup: the longest suffix matched")
    tensor_parallel_size: int = option(1, "chips in the tensor-parallel mesh", minimum=1)
    # Each device holds E / ep experts, on an "expert" mesh axis beside "tp" (ep x tp devices in
    # all); must divide num_experts and the device count (docs/scaling.md).
    expert_parallel_size: int = option(1, "devices the MoE experts split over (beside tp)", minimum=1)
    # A speculative step reads the one before it first (it proposes from every token). Outputs are
    # the same either way.
    async_scheduling: bool = option(True, "dispatch each decode step before reading the previous one's tokens")
    # vLLM's --num-scheduler-steps (runner/decode_loop.py): when every running sequence is a plain
    # decode (no grammar, penalties or logprobs) and no prompt waits for a free slot, the host
    # schedules, dispatches and reads tokens once per that many steps: 8 cuts its work per step
    # about 8x and served the thin, deep model 1.8x faster on the CPU (docs/benchmarks.md). The
    # price: a request that arrives meanwhile waits for the call to end, and a stream gets its
    # tokens that many at a time. 1: a call a step, a streamed chunk a token, as vLLM serves.
    num_scheduler_steps: int = option(
        1, "decode steps one device call may run when every sequence plainly decodes (8 for throughput)", minimum=1
    )
    # One executable per prefill bucket, compiled at warm-up (lm-eval's loglikelihood needs it).
    enable_prompt_logprobs: bool = option(True, "serve prompt_logprobs (off: such requests are refused)")
    compilation_cache_dir: str | None = option(
        None, "keep compiled steps here: a restart skips compilation (persistent XLA cache)"
    )
    seed: int = option(0, "the engine's random seed (requests without a seed)", cli=False)
    tool_call_parser: str | None = option(
        None, "how the model writes tool calls (default: picked from the chat template)", choices=_tool_parsers
    )

    def __post_init__(self):
        for f in dataclasses.fields(self):
            _validate(f, getattr(self, f.name))
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(
                f"prompt_lookup_max must be >= prompt_lookup_min ({self.prompt_lookup_min}), got {self.prompt_lookup_max}"
            )
        if self.speculative_model is not None and self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")


# -- the declaration, read back -----------------------------------------------------------------
@functools.cache
def hints() -> dict[str, Any]:
    """Each field's type annotation, resolved."""
    return typing.get_type_hints(EngineConfig)


def choices_of(f: dataclasses.Field) -> tuple[str, ...] | None:
    c = f.metadata["choices"]
    return tuple(c() if callable(c) else c) if c is not None else None


def flag_of(f: dataclasses.Field) -> str | None:
    """The command-line flag of a field (None: gin only)."""
    if not f.metadata["cli"]:
        return None
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def check_type(name: str, hint: Any, value: Any) -> Any:
    """value checked against a field's annotation by pydantic (strict: '4' is not an int, 1 not a
    bool; an int is a float; a list is a tuple); ValueError "NAME must be TYPE, got VALUE (T)"."""
    try:
        return _adapter(hint).validate_python(tuple(value) if isinstance(value, list) else value)
    except ValidationError:
        raise ValueError(f"{name} must be {type_name(hint)}, got {value!r} ({type(value).__name__})") from None


@functools.cache
def _adapter(hint: Any) -> TypeAdapter:
    return TypeAdapter(hint, config=ConfigDict(strict=True))


def type_name(hint: Any) -> str:
    """'int or None', 'a tuple of int': an annotation as an error message or the docs say it."""
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return " or ".join(type_name(a) for a in args)
    if typing.get_origin(hint) is tuple:
        return f"a tuple of {type_name(args[0])}"
    return "None" if hint is type(None) else getattr(hint, "__name__", str(hint))


def _validate(f: dataclasses.Field, v: Any) -> None:
    """One field against its declaration; ValueError naming it."""
    if v is None and f.default is None:
        return
    m = f.metadata
    if m["minimum"] is not None and v is not None and v < m["minimum"]:
        raise ValueError(f"{f.name} must be >= {m['minimum']}, got {v}")
    allowed = choices_of(f)
    if allowed is not None and v not in allowed:
        raise ValueError(f"{f.name} must be one of {', '.join(allowed)}, got {v!r}")
    why = m["check"](v) if m["check"] is not None else None
    if why:
        raise ValueError(f"{f.name} {why}, got {v!r}")
