"""EngineConfig: what one engine is built with. Plain Python (no jax), so the gin layer and
the CLI can validate a deployment without loading weights or touching a device."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_slots: int = 16
    page_size: int = 16
    max_model_len: int | None = None  # default: the model's context, capped at 2048
    num_pages: int | None = None  # default: sized from kv_cache_memory_bytes
    kv_cache_memory_bytes: int | None = None  # default: accelerator memory left, or 2 GiB on CPU
    memory_fraction: float = 0.9
    # The token budget of one step (decode rows first, then prompt chunks): default 256 on the
    # CPU, 512 elsewhere. The step is padded to a token bucket: powers of two from 16 up to the
    # budget (on the CPU 1 and 8 too), or `token_buckets` as given (the last is the budget).
    max_num_batched_tokens: int | None = None
    token_buckets: tuple[int, ...] | None = None
    # The prompt tokens one step may carry while any sequence is decoding (None: the whole
    # budget). A streaming client's inter-token gap is the step's time, and on a CPU every prompt
    # token in a step costs compute: a small value keeps each step near a decode step's time
    # (`jaxserve serve` sets 64 on the CPU: docs/serving.md, "Inter-token latency").
    max_prefill_tokens_while_decoding: int | None = None
    dtype: str | None = None  # "float32" | "bfloat16"; default by backend
    quantization: str | None = None  # None | "int8": weight-only int8, per-output-channel scales
    # "auto" (pages in dtype; bfloat16 on a CPU that computes in bfloat16 by default) | "float32"
    # | "bfloat16" | "int8" | "fp8" (8-bit pages, per-token-per-head scales)
    kv_cache_dtype: str = "auto"
    attention_impl: str | None = None  # "xla" | "pallas" | "native"; default pallas on TPU/GPU, native on CPU
    # The projections' matmul: "native" (CPU: weights packed into panels, streamed by the C++
    # kernel) | "xla"; default native on the CPU where the kernel is built, xla elsewhere.
    matmul_impl: str | None = None
    # The native matmul's float weights: "bfloat16" (AMX tiles or AVX512-BF16, half the bytes a decode step
    # reads; activations, norms and attention's arithmetic stay float32, and the KV pages follow
    # to bfloat16 unless kv_cache_dtype says otherwise) | "float32" (the exact float32 path).
    # Default: bfloat16 where the CPU has AMX or AVX512-BF16 and `dtype` is not given, else float32.
    matmul_dtype: str | None = None
    interpret: bool | None = None  # run Pallas kernels interpreted (default: on CPU)
    enable_prefix_caching: bool = True
    speculative_model: str | None = None  # a draft checkpoint directory, or "ngram" (prompt lookup)
    num_speculative_tokens: int = 4
    # A step with more decoding sequences than this runs as a plain step (vLLM's option of the same
    # name): verifying k + 1 tokens a sequence pays where a step is memory-bound, and loses where
    # its rows make it compute-bound. Default: on the CPU 16 // (k + 1) (a CPU step turns
    # compute-bound at about 16 rows: 4 sequences at k = 3), elsewhere None (always speculate).
    speculative_disable_by_batch_size: int | None = None
    # Prompt lookup ("ngram", vLLM's options of the same names): drafts follow the most recent
    # earlier occurrence of the longest suffix of prompt_lookup_max down to prompt_lookup_min
    # tokens. A longer minimum proposes less often and is right more often (a 1-token match
    # in chat is a poor guess, and a verify row costs more than a decode row on a CPU). On the
    # default model 2 proposed in half the code steps instead of 77%, for 2.13 tokens a step
    # instead of 2.29, and served code 1.53x plain against 1.44x.
    prompt_lookup_min: int = 2
    # Prompt lookup chooses each step's drafts per request (engine/spec_policy.py): from 0 (a
    # plain, overlapped step) to num_speculative_tokens, by that request's measured acceptance
    # and the step times measured on this host; False: every row proposes up to k.
    speculative_adaptive: bool = True
    prompt_lookup_max: int = 3
    tensor_parallel_size: int = 1
    # Mixture-of-experts models: the devices the experts split over (each holds E / ep of them), an
    # "expert" mesh axis beside "tp" (ep x tp devices in all); must divide num_experts and the
    # device count (docs/scaling.md).
    expert_parallel_size: int = 1
    # Dispatch each decode step before reading the previous one's tokens (host work hidden
    # behind the device); a speculative step reads the one before it first (it proposes from
    # every token). Outputs are the same either way.
    async_scheduling: bool = True
    # Decode steps one device call may run (vLLM's --num-scheduler-steps; runner/decode_loop.py):
    # when every running sequence is a plain decode (no grammar, penalties or logprobs) and no
    # prompt waits for a free slot, the host schedules, dispatches and reads tokens once per that
    # many steps: 8 cuts its work per step about 8x and served the thin, deep model 1.8x faster
    # on the CPU (docs/benchmarks.md). The price: a request that arrives meanwhile waits for the
    # call to end, and a stream gets its tokens that many at a time. 1 (default): a call a step,
    # a streamed chunk a token, as vLLM serves.
    num_scheduler_steps: int = 1
    # The scoring prefill of requests with prompt_logprobs (lm-eval's loglikelihood): compiled at
    # warm-up, one executable per prefill bucket; off, such requests are refused.
    enable_prompt_logprobs: bool = True
    compilation_cache_dir: str | None = None  # persistent XLA cache: a restart skips compilation
    seed: int = 0
    # How the model writes tool calls (engine/tool_calls.py): "hermes" | "smollm2" | "llama3_json"
    # | "mistral"; default: picked from the chat template.
    tool_call_parser: str | None = None

    def __post_init__(self):
        for name in (
            "max_slots",
            "page_size",
            "max_model_len",
            "num_pages",
            "kv_cache_memory_bytes",
            "tensor_parallel_size",
            "expert_parallel_size",
            "max_num_batched_tokens",
            "max_prefill_tokens_while_decoding",
            "speculative_disable_by_batch_size",
            "prompt_lookup_min",
            "num_scheduler_steps",
        ):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.dtype not in (None, "float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.kv_cache_dtype not in ("auto", "float32", "bfloat16", "int8", "fp8"):
            raise ValueError(
                f"kv_cache_dtype must be 'auto', 'float32', 'bfloat16', 'int8' or 'fp8', got {self.kv_cache_dtype!r}"
            )
        if self.quantization not in (None, "int8"):
            raise ValueError(f"quantization must be None or 'int8', got {self.quantization!r}")
        if self.attention_impl not in (None, "xla", "pallas", "native"):
            raise ValueError(f"attention_impl must be 'xla', 'pallas' or 'native', got {self.attention_impl!r}")
        if self.matmul_impl not in (None, "xla", "native"):
            raise ValueError(f"matmul_impl must be 'xla' or 'native', got {self.matmul_impl!r}")
        if self.matmul_dtype not in (None, "float32", "bfloat16"):
            raise ValueError(f"matmul_dtype must be 'float32' or 'bfloat16', got {self.matmul_dtype!r}")
        tb = self.token_buckets
        if tb is not None and (not tb or list(tb) != sorted(set(tb)) or tb[0] < 1):
            raise ValueError(f"token_buckets must be increasing positive sizes, got {tb}")
        from jaxserve.engine.tool_calls import PARSERS

        if self.tool_call_parser not in (None, *PARSERS):
            raise ValueError(f"tool_call_parser must be one of {', '.join(PARSERS)}, got {self.tool_call_parser!r}")
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(
                f"prompt_lookup_max must be >= prompt_lookup_min ({self.prompt_lookup_min}), got {self.prompt_lookup_max}"
            )
        if self.speculative_model is not None and self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
