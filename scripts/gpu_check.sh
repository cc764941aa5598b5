#!/usr/bin/env bash
# One prepared run on a lent GPU machine (the device tool; see docs/kernels.md "H200 results"):
# the ragged Pallas kernel compiled by Triton against the jnp oracle, the kernels' timings beside
# their bounds, the engine on it against the XLA path (bench quality), and `jaxserve bench throughput` on
# mixed-64 with the Pallas and the XLA attention alternating. Logs and JSON go to $OUT (or ./gpu-out).
#   bash scripts/gpu_check.sh [STEP ...]   (default: every step; wheels for packages the machine lacks in
#                                          .whl/, never flax: the image's matches its jax; mixed-64 in .devdata/)
set -u
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then
  echo "usage: bash scripts/gpu_check.sh [-h|--help] [kernel-tests] [bench-kernels] [throughput] [engine-check]"
  echo "  on a GPU: the ragged Pallas kernel's tests, bench kernels, bench throughput (Pallas against XLA"
  echo "  attention on .devdata/mixed-64.json) and the engine on both (bench quality); logs and JSON in \$OUT"
  exit 0
fi
STEPS=" ${*:-kernel-tests bench-kernels throughput engine-check} "
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
start=$(date +%s)
step() {  # step NAME SECONDS CMD...: run with a limit, log to $OUT/NAME.log, never stop the script
  local name=$1 limit=$2; shift 2
  [[ $STEPS == *" $name "* ]] || return 0
  echo "== $name ($(( $(date +%s) - start )) s in) $*"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "== $name rc=$rc"; grep -v -E "absl|^\s*$" "$OUT/$name.log" | tail -n 25
}
{ date -u; nvidia-smi -L; python3 -V; python3 -c "import jax, flax, jaxlib; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"; } 2>&1 | tee "$OUT/env.log"
# float32 oracles at full precision (XLA would use TF32 on a GPU); each lowering compiles where it is native
export JAX_DEFAULT_MATMUL_PRECISION=highest
step kernel-tests 100 python3 -m pytest -q -p no:cacheprovider tests/test_ragged_paged_attention.py \
  --maxfail=3 -k "not compiled_lowerings"
unset JAX_DEFAULT_MATMUL_PRECISION
step bench-kernels 100 python3 -m jaxserve.cli bench kernels --rows 1,16,64 --contexts 1024,4096 --heads 32/8 \
  --head-dim 128 --ragged-steps 1x8192+0,16x4096+0,16x4096+256,64x2048+512@2048,0x0+2048 \
  --peak-tflops 989 --reps 5 --out "$OUT/kernels.json"
step throughput 170 python3 -m jaxserve.cli bench throughput --model workload --workload-file .devdata/mixed-64.json \
  --engine-opts '{"attention_impl": "pallas", "max_slots": 64, "kv_cache_memory_bytes": 4294967296}' \
  --engine-opts '{"attention_impl": "xla", "max_slots": 64, "kv_cache_memory_bytes": 4294967296}' \
  --rounds 2 --out "$OUT/throughput.json"
# the engine on the Pallas kernel against the XLA path, greedy, float32 at the highest matmul precision (so
# the two differ only by summation order): how many tokens agree. No warm-up: each compiles only the steps run.
engine='"dtype": "float32", "max_slots": 16, "max_model_len": 1024, "token_buckets": [16, 256], "kv_cache_memory_bytes": 2147483648, "warmup": false'
export JAX_DEFAULT_MATMUL_PRECISION=highest
step engine-check 150 python3 -m jaxserve.cli bench quality \
  --model .devdata/mixed-64.json --windows 0 --random-prompts --num-prompts 8 --prompt-len 256 --output-len 16 \
  --engine-opts "{\"attention_impl\": \"xla\", $engine}" --engine-opts "{\"attention_impl\": \"pallas\", $engine}" \
  --out "$OUT/engine-check.json"
unset JAX_DEFAULT_MATMUL_PRECISION
echo "done in $(( $(date +%s) - start )) s"
