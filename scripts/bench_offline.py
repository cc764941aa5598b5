"""Offline throughput: jaxserve against transformers' static batching, side by side.

Replays ../shared/workloads/mixed-64.json (64 requests, greedy, no EOS) on the random
Llama the workload describes. The baseline is what the workload's `baseline` field says:
transformers `generate` in batches of 16, left padding, each batch running until its
longest request is done. Reports useful output tokens per second, the ratio, and KV waste.

    .venv/bin/python scripts/bench_offline.py [--workload F] [--skip-bf16] [--max-slots N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_WORKLOAD = REPO.parent / "shared" / "workloads" / "mixed-64.json"


def build_model(spec: dict, out: Path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=spec["hidden_size"],
        num_hidden_layers=spec["num_hidden_layers"],
        num_attention_heads=spec["num_attention_heads"],
        num_key_value_heads=spec["num_key_value_heads"],
        intermediate_size=spec["intermediate_size"],
        vocab_size=spec["vocab_size"],
        max_position_embeddings=spec["max_position_embeddings"],
        tie_word_embeddings=spec["tie_word_embeddings"],
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(out)
    return model


def run_transformers(model, reqs, batch_size: int, dtype) -> tuple[float, list[list[int]]]:
    import torch

    m = model.to(dtype)
    outs = []
    t0 = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i : i + batch_size]
        width = max(r["prompt_len"] for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, r in enumerate(batch):
            ids[j, width - r["prompt_len"] :] = torch.tensor(r["prompt_ids"])
            mask[j, width - r["prompt_len"] :] = 1
        n = max(r["output_len"] for r in batch)
        with torch.no_grad():
            gen = m.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )
        for j, r in enumerate(batch):
            outs.append(gen[j, width : width + r["output_len"]].tolist())
    m.to(torch.float32)
    return time.perf_counter() - t0, outs


class KVWaste:
    """Reserved-but-unused KV token slots over used ones, integrated over engine steps."""

    def __init__(self, page_size: int, max_model_len: int):
        self.ps, self.max_len = page_size, max_model_len
        self.used = self.reserved = self.contiguous = self.contiguous_max = 0

    def sample(self, running) -> None:
        for s in running:
            used = s.num_computed
            if used == 0:
                continue
            self.used += used
            self.reserved += len(s.pages) * self.ps
            self.contiguous += len(s.prompt_ids) + s.params.max_tokens  # reserve prompt + max_tokens up front
            self.contiguous_max += self.max_len  # reserve max_model_len per request (static batching)

    def report(self) -> dict:
        return {
            "paged_waste": (self.reserved - self.used) / max(self.used, 1),
            "contiguous_request_max_waste": (self.contiguous - self.used) / max(self.used, 1),
            "contiguous_model_max_waste": (self.contiguous_max - self.used) / max(self.used, 1),
        }


def run_jaxserve(llm, reqs, waste: KVWaste | None):
    from jaxserve import SamplingParams

    llm.flush_prefix_cache()  # every run starts cold: no prompt is served from an earlier run's cache
    prompts = [r["prompt_ids"] for r in reqs]
    params = [SamplingParams(max_tokens=r["output_len"], temperature=0, ignore_eos=True) for r in reqs]
    seqs = [llm.make_sequence(p, sp) for p, sp in zip(prompts, params)]
    for s in seqs:
        llm.submit(s)
    t0 = time.perf_counter()
    steps = 0
    while llm.has_unfinished():
        llm.step()
        steps += 1
        if waste is not None:
            waste.sample(llm.scheduler.running)
    return time.perf_counter() - t0, [s.output_ids for s in seqs], steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default=str(DEFAULT_WORKLOAD))
    ap.add_argument("--max-slots", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-prefill-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3, help="jaxserve runs (median reported)")
    ap.add_argument("--defaults", action="store_true", help="LLM(path) with no options instead of the tuned ones")
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--skip-bf16", action="store_true")
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(2)
    wl = json.loads(Path(args.workload).read_text())
    reqs = wl["requests"]
    useful = sum(r["output_len"] for r in reqs)
    results = {"workload": Path(args.workload).name, "useful_output_tokens": useful}
    with tempfile.TemporaryDirectory() as tmp:
        hf = build_model(wl["model"], Path(tmp))
        from jaxserve import LLM

        t0 = time.perf_counter()
        if args.defaults:  # what a user gets from LLM(path): no tuned option
            llm = LLM(tmp)
        else:
            llm = LLM(
                tmp,
                max_slots=args.max_slots,
                page_size=args.page_size,
                max_model_len=1024,
                max_prefill_tokens=args.max_prefill_tokens,
            )
        results["jaxserve_options"] = "defaults" if args.defaults else "tuned"
        results["attention_impl"] = llm.runner.attention_impl
        results["jaxserve_startup_s"] = time.perf_counter() - t0
        times, waste = [], KVWaste(args.page_size, 1024)
        for i in range(args.repeats):
            secs, js_out, steps = run_jaxserve(llm, reqs, waste if i == 0 else None)
            times.append(secs)
            print(f"jaxserve run {i}: {secs:.2f}s, {useful / secs:.0f} tok/s, {steps} steps", flush=True)
        js = statistics.median(times)
        results.update(
            jaxserve_s=js,
            jaxserve_tok_s=useful / js,
            jaxserve_runs_s=times,
            jaxserve_compiles_after_warmup=llm.compiles_since_warmup(),
            preemptions=llm.scheduler.num_preemptions,
            **waste.report(),
        )
        w = waste.report()
        print(
            f"KV waste (reserved but unused / used, over every step): paged {w['paged_waste']:.2%}; "
            f"contiguous prompt+max_tokens reservation {w['contiguous_request_max_waste']:.2%}; "
            f"contiguous max_model_len ({waste.max_len}) reservation {w['contiguous_model_max_waste']:.2%}",
            flush=True,
        )
        if not args.skip_baseline:
            hf_s, hf_out = run_transformers(hf, reqs, wl.get("hf_batch_size", 16), torch.float32)
            results.update(hf_fp32_s=hf_s, hf_fp32_tok_s=useful / hf_s)
            agree = sum(a == b for a, b in zip(hf_out, js_out))
            results["greedy_outputs_equal_to_hf_fp32"] = f"{agree}/{len(reqs)}"
            print(
                f"transformers fp32: {hf_s:.2f}s, {useful / hf_s:.0f} tok/s; identical outputs {agree}/{len(reqs)}",
                flush=True,
            )
            best = useful / hf_s
            if not args.skip_bf16:
                bf_s, _ = run_transformers(hf, reqs, wl.get("hf_batch_size", 16), torch.bfloat16)
                results.update(hf_bf16_s=bf_s, hf_bf16_tok_s=useful / bf_s)
                print(f"transformers bf16: {bf_s:.2f}s, {useful / bf_s:.0f} tok/s", flush=True)
                best = max(best, useful / bf_s)
            results["ratio_vs_best_transformers"] = results["jaxserve_tok_s"] / best
            print(
                f"jaxserve {results['jaxserve_tok_s']:.0f} tok/s = {results['ratio_vs_best_transformers']:.2f}x "
                f"the faster transformers run",
                flush=True,
            )
    print(json.dumps(results, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
