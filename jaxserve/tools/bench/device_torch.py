"""The torch section of `jaxserve bench device`: the reference stack on the same chip, same window.

Runs in a process of its own that never imports jax (so the two never share the GPU's memory).
- probes in torch's hands: the same copy and matmul as the probes section (a second reading of
  the ceilings, by another compiler).
- `scaled_dot_product_attention` prefill at the kernels section's S, with its flash and cuDNN
  backends forced one at a time (GQA through enable_gqa).
- transformers' `generate` on the engine's model shape (bfloat16, random weights made on the
  device): TPOT at batch 1 and at the engine's slot count, (time of 1 + n tokens - time of 1
  token) / n. The floor an engine must clear.
Timed with torch.cuda.Event on a GPU ("cuda-event"), the wall clock elsewhere; an item this
platform cannot run (cuDNN on a CPU) is recorded as {"error": ...}.
"""

from __future__ import annotations

import statistics
import time

from jaxserve.tools.bench.device_timing import Record, error_text


class _Clock:
    """ms of fn(): CUDA events around it on a GPU, the wall clock (after a sync) elsewhere."""

    def __init__(self, torch, device: str):
        self.torch, self.cuda = torch, device == "cuda"
        self.name = "cuda-event" if self.cuda else "wall-clock"

    def ms(self, fn) -> float:
        torch = self.torch
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3


def run_torch(plan: dict, rec: Record) -> None:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, plan.get("dtype") or ("bfloat16" if device == "cuda" else "float32"))
    clock = _Clock(torch, device)
    rec.extra["torch"] = {"version": torch.__version__, "device": torch.cuda.get_device_name() if device == "cuda"
                          else "cpu", "timing": clock.name}  # fmt: skip
    rec.flush()
    with torch.inference_mode():
        _probes(torch, plan, rec, clock, device, dtype)
        _sdpa(torch, plan, rec, clock, device, dtype)
        _generate(torch, plan, rec, clock, device, dtype)


def _add(rec: Record, base: dict, measure) -> None:
    if rec.left_s() <= 0:
        rec.add({**base, "error": "skipped: the section's time budget was spent"})
        return
    try:
        row = rec.add({**base, **measure()})
        print(f"torch {row['name']} {row['impl']} {row['config']}: {row['ms']:.3f} ms ({row['timing']})", flush=True)
    except Exception as e:
        rec.add({**base, "error": error_text(e)})


def _best(clock, fn, reps: int) -> list[float]:
    fn()  # warm
    return [clock.ms(fn) for _ in range(reps)]


def _probes(torch, plan, rec, clock, device, dtype) -> None:
    n, reps = plan["gemm_n"], plan["reps"]

    def copy():
        x = torch.ones(plan["copy_bytes"] // 4, dtype=torch.float32, device=device)
        times = _best(clock, lambda: x + 1, reps)
        return {"ms": min(times), "timing": clock.name, "bytes": 2 * x.nbytes}

    def gemm():
        a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
        times = _best(clock, lambda: a @ b, reps)
        return {"ms": min(times), "timing": clock.name, "flops": 2 * n**3, "bytes": 3 * a.nbytes}

    _add(rec, {"name": "probe copy", "impl": "torch", "config": {"bytes": plan["copy_bytes"]}}, copy)
    _add(rec, {"name": "probe gemm", "impl": "torch", "config": {"n": n, "dtype": str(dtype)}}, gemm)


def _sdpa(torch, plan, rec, clock, device, dtype) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    h, kvh, d = plan["heads"], plan["kv_heads"], plan["head_dim"]
    for s in plan["prefill"]:
        q = torch.randn(1, h, s, d, dtype=dtype, device=device)
        k, v = (torch.randn(1, kvh, s, d, dtype=dtype, device=device) for _ in range(2))
        nbytes, flops = 2 * q.nbytes + k.nbytes + v.nbytes, 4 * h * d * s * (s + 1) // 2
        config = {"tokens": s, "heads": h, "kv_heads": kvh, "head_dim": d, "dtype": str(dtype)}
        for name, backend in (("torch-sdpa-flash", SDPBackend.FLASH_ATTENTION), ("torch-sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):  # fmt: skip

            def measure(backend=backend):
                with sdpa_kernel([backend]):
                    try:
                        times = _best(clock, lambda: sdpa(q, k, v, is_causal=True, enable_gqa=True), plan["reps"])
                        gqa = "enable_gqa"
                    except RuntimeError:  # a backend without GQA: K and V repeated per query head, untimed
                        ke, ve = (x.repeat_interleave(h // kvh, dim=1) for x in (k, v))
                        times = _best(clock, lambda: sdpa(q, ke, ve, is_causal=True), plan["reps"])
                        gqa = "repeated"
                return {"ms": statistics.median(times), "timing": clock.name, "gqa": gqa}

            _add(rec, {"name": "prefill", "impl": name, "config": config, "bytes": nbytes, "flops": flops}, measure)


def _generate(torch, plan, rec, clock, device, dtype) -> None:
    """transformers' generate, greedy, TPOT at each batch of plan["generate_batches"]."""
    model = {}

    def build():
        from transformers import AutoModelForCausalLM, LlamaConfig

        fields = {k: v for k, v in plan["config"].items() if k not in ("architectures", "model_type", "torch_dtype")}
        torch.manual_seed(0)
        t0 = time.perf_counter()
        with torch.device(device):  # made where it runs, in its dtype from the start
            model["m"] = AutoModelForCausalLM.from_config(LlamaConfig(**fields), dtype=dtype).eval()
        return {"ms": (time.perf_counter() - t0) * 1e3, "timing": "wall-clock",
                "dtype": str(next(model["m"].parameters()).dtype)}  # fmt: skip

    _add(rec, {"name": "transformers model init", "impl": "transformers", "config": {"device": device}}, build)
    n, vocab = plan["tpot_tokens"], plan["config"]["vocab_size"]
    for batch in plan["generate_batches"]:
        # at the engine's slot count, its throughput prompts (the decode step it is compared with)
        p = plan["throughput_prompt"] if batch == plan["slots"] else plan["tpot_prompt"]

        def tpot(batch=batch, p=p):
            ids = torch.randint(3, vocab, (batch, p), device=device)
            run = lambda k: model["m"].generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k,  # noqa: E731
                                                min_new_tokens=k, do_sample=False, pad_token_id=0)  # fmt: skip
            one = _best(clock, lambda: run(1), plan.get("gen_reps", 2))
            more = _best(clock, lambda: run(n + 1), plan.get("gen_reps", 2))
            ms = (statistics.median(more) - statistics.median(one)) / n
            if ms <= 0:
                raise ValueError(f"{n} more tokens took no longer than one: the timer's noise exceeds the decode")
            return {"ms": ms, "timing": clock.name, "output_tok_s": batch / ms * 1e3}

        base = {
            "name": "transformers TPOT",
            "impl": "transformers",
            "config": {"rows": batch, "prompt": p, "tokens": n},
        }
        if "m" not in model:
            rec.add({**base, "error": "no model (its init failed)"})
        else:
            _add(rec, base, tpot)
