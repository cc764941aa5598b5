"""An engine in a process of its own, for `jaxserve bench throughput --vllm-python` (vLLM's offline
`LLM` in its own venv) and `--baseline-checkout` (jaxserve's `LLM` from another checkout).

Run as a script by that interpreter (it imports the engine it runs and nothing else):

    PYTHON jaxserve/tools/bench/worker.py vllm|jaxserve MODEL_DIR '{"dtype": "bfloat16"}' ids|text

It loads the model, runs one short request outside any timing, prints a "JAXSERVE-READY" line,
then answers each line of stdin, a JSON list of requests [prompt (ids or text), max_tokens,
temperature, top_p], with one line "JAXSERVE {"wall_s", "requests": [[prompt tokens, output
tokens], ...]}": the whole batch through `LLM.generate`, greedy or seeded, EOS ignored.
"""

import json
import os
import sys
import time

# run as a script, this file's directory leads sys.path: its neighbours (profile.py, ...) would
# shadow the standard library (and vLLM's spawned engine process runs this file again)
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]


def vllm_engine(model: str, opts: dict, ids: bool):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, skip_tokenizer_init=ids, **opts)

    def run(reqs):
        prompts = [TokensPrompt(prompt_token_ids=p) if ids else p for p, *_ in reqs]
        params = [
            SamplingParams(max_tokens=n, temperature=t, top_p=top_p, seed=i, ignore_eos=True, detokenize=False)
            for i, (_, n, t, top_p) in enumerate(reqs)
        ]
        return [(len(o.prompt_token_ids), len(o.outputs[0].token_ids)) for o in llm.generate(prompts, params)]

    return run


def jaxserve_engine(model: str, opts: dict, ids: bool):
    from jaxserve import LLM, SamplingParams

    llm = LLM(model, **{k: tuple(v) if isinstance(v, list) else v for k, v in opts.items()})

    def run(reqs):
        params = [
            SamplingParams(max_tokens=n, temperature=t, top_p=top_p, seed=i, ignore_eos=True)
            for i, (_, n, t, top_p) in enumerate(reqs)
        ]
        return [(len(o.prompt_token_ids), len(o.token_ids)) for o in llm.generate([r[0] for r in reqs], params)]

    return run


def main() -> None:
    kind, model, opts, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
    run = (vllm_engine if kind == "vllm" else jaxserve_engine)(model, opts, prompts == "ids")
    run([([3 + i for i in range(16)] if prompts == "ids" else "w3 w4 w5 w6", 4, 0.0, 1.0)])
    print("JAXSERVE-READY", flush=True)
    for line in sys.stdin:
        reqs = json.loads(line)
        t0 = time.perf_counter()
        counts = run(reqs)
        print("JAXSERVE " + json.dumps({"wall_s": time.perf_counter() - t0, "requests": counts}), flush=True)


if __name__ == "__main__":
    main()
