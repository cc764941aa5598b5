"""`make demo`: start jaxserve on the default model (SmolLM2-135M-Instruct), stream its answers
to two chat questions through the gRPC client to the terminal, and stop the server with
SIGTERM (it drains)."""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time

QUESTIONS = ["What is the capital of France?", "Write a Python function that returns the square of a number."]


def main() -> int:
    argparse.ArgumentParser(description=__doc__).parse_args()
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--port", "0", "--max-slots", "4"]
    print("$ " + " ".join(["jaxserve"] + cmd[3:]), flush=True)
    t0 = time.perf_counter()
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    target = None
    try:
        for line in server.stdout:
            if "[jaxserve]" in line or "serving on" in line or "Traceback" in line or "Error:" in line:
                print("  [server] " + line.rstrip()[-110:], flush=True)
            m = re.search(r"serving on ([\d.]+:\d+)", line)
            if m:
                target = m.group(1)
                break
        if target is None:
            print("the server did not start", file=sys.stderr)
            return 1
        threading.Thread(target=lambda: [None for _ in server.stdout], daemon=True).start()
        print(f"server ready on {target} after {time.perf_counter() - t0:.1f}s\n", flush=True)
        from jaxserve.serving.client import Client

        client = Client(target)
        for question in QUESTIONS:
            print(f"$ jaxserve client --target {target} --chat {question!r}", flush=True)
            last = None
            t1 = time.perf_counter()
            for r in client.generate([{"role": "user", "content": question}], max_tokens=160, temperature=0):
                print(r.text, end="", flush=True)
                last = r
            u = last.usage
            print(
                f"\n[{u.completion_tokens} tokens streamed in {time.perf_counter() - t1:.1f}s; "
                f"prompt {u.prompt_tokens} tokens]\n",
                flush=True,
            )
        client.close()
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    print("server stopped (SIGTERM drained it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
