#!/bin/bash
# Serving side by side: `jaxserve serve` and vLLM's OpenAI server on the same model, driven by
# `jaxserve bench serve` (Poisson arrivals, the long-short mix; rounds alternate the order).
#
#   scripts/bench_serve_vllm.sh MODEL_DIR VLLM_PYTHON [extra jaxserve serve flags...]
#
# MODEL_DIR needs a tokenizer both servers load: scripts/add_word_tokenizer.py gives the random
# 56.4M Llama (/tmp/jaxserve-bench-56m, copied) a word-level one. RATE (2), ROUNDS (2), REQUESTS (48), VLLM_DTYPE (bfloat16) from the environment;
# the result JSON goes to OUT (default /tmp/serve_ab.json, outside the checkout).
set -u
model=$1 vllm_python=$2
shift 2
here=$(cd "$(dirname "$0")/.." && pwd)
jx=$here/.venv/bin
JAX_PLATFORMS=cpu "$jx/jaxserve" serve --model "$model" --http-port 8123 --no-grpc "$@" > /tmp/jaxserve-serve.log 2>&1 &
jpid=$!
VLLM_CPU_KVCACHE_SPACE=4 "$vllm_python" -m vllm.entrypoints.openai.api_server --model "$model" --host 127.0.0.1 \
  --port 8124 --dtype "${VLLM_DTYPE:-bfloat16}" > /tmp/vllm-serve.log 2>&1 &
vpid=$!
trap 'kill $jpid $vpid 2>/dev/null; wait' EXIT
for port in 8123 8124; do
  for _ in $(seq 1 200); do curl -sf "http://127.0.0.1:$port/v1/models" > /dev/null && break; sleep 3; done
done
"$jx/jaxserve" bench serve --base-url http://127.0.0.1:8123 --base-url http://127.0.0.1:8124 --rate "${RATE:-2}" \
  --num-requests "${REQUESTS:-48}" --workload long-short --vocab-size 32000 --rounds "${ROUNDS:-2}" --out "${OUT:-/tmp/serve_ab.json}"
