"""vLLM's offline `LLM` in a process of its own venv, for `jaxserve bench throughput --vllm-python`.

Run as a script by that venv's python (it imports vllm, never jaxserve):

    VLLM_PYTHON jaxserve/tools/bench/vllm_worker.py MODEL_DIR '{"dtype": "bfloat16"}' ids|text

It loads the model, runs one short request outside any timing, prints a "JAXSERVE-READY" line,
then answers each line of stdin, a JSON list of requests [prompt (ids or text), max_tokens,
temperature, top_p], with one line "JAXSERVE {"wall_s", "requests": [[prompt tokens, output
tokens], ...]}": the whole batch through `LLM.generate`, greedy or seeded, EOS ignored.
"""

import json
import sys
import time


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model, opts, kind = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    llm = LLM(model=model, skip_tokenizer_init=kind == "ids", **opts)

    def run(reqs):
        prompts = [TokensPrompt(prompt_token_ids=p) if kind == "ids" else p for p, *_ in reqs]
        params = [
            SamplingParams(max_tokens=n, temperature=t, top_p=top_p, seed=i, ignore_eos=True, detokenize=False)
            for i, (_, n, t, top_p) in enumerate(reqs)
        ]
        return llm.generate(prompts, params, use_tqdm=False)

    run([([3 + i for i in range(16)] if kind == "ids" else "w3 w4 w5 w6", 4, 0.0, 1.0)])
    print("JAXSERVE-READY", flush=True)
    for line in sys.stdin:
        reqs = json.loads(line)
        t0 = time.perf_counter()
        outs = run(reqs)
        wall = time.perf_counter() - t0
        counts = [[len(o.prompt_token_ids), len(o.outputs[0].token_ids)] for o in outs]
        print("JAXSERVE " + json.dumps({"wall_s": wall, "requests": counts}), flush=True)


if __name__ == "__main__":
    main()
