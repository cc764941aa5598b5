#!/usr/bin/env bash
# The prepared run on a lent accelerator (the device tool; docs/kernels.md "The prepared accelerator run"):
# `jaxserve bench device` (probes, attention kernels, the engine on a Llama-3.1-8B-shaped model, the torch
# reference), at most 8 minutes, then optionally the ragged kernel's tests. JSON, the engine's trace and
# logs go to $OUT (or ./gpu-out). Rehearse it on the CPU: JAX_PLATFORMS=cpu bash scripts/gpu_check.sh --rehearse
set -u
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then
  echo "usage: bash scripts/gpu_check.sh [-h|--help] [--kernel-tests] [BENCH DEVICE FLAGS...]"
  echo "  jaxserve bench device --out \$OUT (e.g. --rehearse, --only probes,kernels, --budget-s 420), then with"
  echo "  --kernel-tests the ragged Pallas kernel's tests compiled for this GPU; wheels the machine lacks in .whl/"
  echo "  (never flax: the image's matches its jax); JAX_PLATFORMS (default cuda), PYTHON (default python3)"
  exit 0
fi
TESTS=0 FLAGS=()
for a in "$@"; do [[ $a == --kernel-tests ]] && TESTS=1 || FLAGS+=("$a"); done
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # this checkout's jaxserve, whatever the image holds
start=$(date +%s)
{ date -u; nvidia-smi -L 2>/dev/null; "$PY" -V; "$PY" -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
  # what the engine imports and an image may lack (docs/kernels.md lists the wheels to carry in .whl/)
  "$PY" -c "import importlib.util as u; m = [n for n in ('gin', 'pydantic', 'flax', 'transformers', 'torch') if not u.find_spec(n)]; print('missing:', ' '.join(m) or 'nothing')"
} 2>&1 | tee "$OUT/env.log"
# the bench's own budgets end it within 8 minutes; the limit here only catches a hang
timeout 500 "$PY" -m jaxserve.cli bench device --out "$OUT" "${FLAGS[@]}" 2>&1 | tee "$OUT/device.log"
echo "== bench device rc=${PIPESTATUS[0]} ($(( $(date +%s) - start )) s in)"
if (( TESTS )); then  # float32 oracles at full precision (XLA would use TF32 on a GPU)
  JAX_DEFAULT_MATMUL_PRECISION=highest timeout 100 "$PY" -m pytest -q -p no:cacheprovider \
    tests/test_ragged_paged_attention.py --maxfail=3 -k "not compiled_lowerings" > "$OUT/kernel-tests.log" 2>&1
  echo "== kernel-tests rc=$?"; tail -n 5 "$OUT/kernel-tests.log"
fi
echo "done in $(( $(date +%s) - start )) s"
