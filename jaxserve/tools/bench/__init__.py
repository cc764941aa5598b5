"""`jaxserve bench`: the benchmark harness, inside the package (it runs from an installed wheel).

- workload.py: the requests (random, shared-prefix, long-short, JSON files), fresh ids per round;
- stats.py: what is measured per request (TTFT, ITL, TPOT, end-to-end) and how it is summed up;
- offline.py: the driver of an LLM in this process; serve.py: the driver of an OpenAI-compatible
  server over HTTP (jaxserve or vLLM);
- ab.py: rounds alternating between configurations, medians and ratios against the first;
- result.py: the one JSON result schema; commands.py: the subcommands' flags and the ones built
  from the pieces above (throughput, latency, serve, prefix, speculative); kernels.py: the kernel
  bench; speculative.py: its prompts;
- the other subcommands, one module each: structured.py, quality.py, startup.py, profile.py,
  lm_eval.py; workers.py + worker.py: vLLM (its own venv) or another checkout of jaxserve in a
  process of its own, beside `throughput`'s LLMs.

docs/benchmarks.md says how to run each subcommand.
"""
