"""Replicas behind a router: two real `jaxserve serve` processes on 127.0.0.1 and the real
vllm-router (PyPI `vllm-router`, installed by the test extra) in front of them, driven with the
`openai` client, as docs/scaling.md tells a user to run them.

The oracles: a replica's own answer to the same request (greedy, so the router must not change
a token), the replica's tokenizer (/tokenize) for what render reports, the replicas' own
/metrics and /get_load for where requests ran and that an abandoned stream was aborted."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from conftest import TEST_MODEL, free_port

ROUTER = Path(sys.executable).parent / "vllm-router"
SERVE = ["--max-slots", "4", "--max-model-len", "256", "--token-buckets", "32,64", "--no-compilation-cache"]
HTTP_LINE = re.compile(r"OpenAI-compatible HTTP on http://127\.0\.0\.1:(\d+)/v1")


def _get(url: str, timeout: float = 10.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        body = r.read()
    return json.loads(body) if body[:1] in (b"{", b"[") else body.decode()


def _post(url: str, body: dict, timeout: float = 30.0) -> tuple[int, dict | list]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _metric(text: str, name: str, **labels) -> float:
    """The sum of a Prometheus sample over the series whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


class Replica:
    """`jaxserve serve --no-grpc --http-port 0` in its own process; the port from its log line."""

    def __init__(self, tmp: Path):
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", JAXSERVE_CACHE_DIR=str(tmp / "converted"))
        cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--model", str(TEST_MODEL), "--no-grpc"]
        self.proc = subprocess.Popen(
            cmd + ["--http-port", "0", "--grace", "1", *SERVE],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.log: list[str] = []

    def wait_ready(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)
            if m := HTTP_LINE.search(line):
                self.url = f"http://127.0.0.1:{m.group(1)}"
                threading.Thread(target=lambda: self.log.extend(self.proc.stdout), daemon=True).start()
                return
        raise AssertionError("the replica did not start:\n" + "".join(self.log[-40:]))

    def metrics(self) -> str:
        return _get(self.url + "/metrics")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class Router:
    """vllm-router on 127.0.0.1 in front of the replicas (its defaults bind loopback too)."""

    def __init__(self, workers: list[str], policy: str, *extra: str):
        self.port = free_port()
        cmd = [str(ROUTER), "--host", "127.0.0.1", "--port", str(self.port), "--prometheus-port", str(free_port())]
        cmd += ["--worker-urls", *workers, "--policy", policy, *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "vllm-router exited at start"
            try:
                _get(self.url + "/v1/models", timeout=2)
                return
            except (urllib.error.URLError, OSError):
                time.sleep(0.2)
        raise AssertionError("vllm-router did not come up")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replicas")
    reps = [Replica(tmp), Replica(tmp)]  # both load and compile at once
    try:
        for r in reps:
            r.wait_ready()
        yield reps
    finally:
        for r in reps:
            r.stop()


@pytest.fixture(scope="module")
def router(replicas):
    # cache_aware, balancing as soon as one replica has a request more than the other (its
    # defaults balance only past 64 requests in flight), and a replica that refuses a connection
    # taken out at once (circuit breaker) and probed every second: docs/scaling.md's settings.
    r = Router(
        [x.url for x in replicas],
        "cache_aware",
        *("--balance-abs-threshold", "1", "--balance-rel-threshold", "1"),
        *("--cb-failure-threshold", "1", "--health-check-interval-secs", "1", "--health-failure-threshold", "1"),
    )
    yield r
    r.stop()


def _prompts(n: int, length: int = 24) -> list[list[int]]:
    return [[int(3 + (7 * i + 13 * j) % 480) for j in range(length)] for i in range(n)]


def test_render_reports_the_ids_and_parameters_the_replica_would_run(replicas):
    url = replicas[0].url
    status, out = _post(url + "/v1/completions/render", {"model": "target", "prompt": "def f(x):", "max_tokens": 7})
    assert status == 200 and len(out) == 1
    assert out[0]["token_ids"] == _post(url + "/tokenize", {"prompt": "def f(x):"})[1]["tokens"]
    assert out[0]["sampling_params"]["max_tokens"] == 7 and out[0]["request_id"].startswith("cmpl-")
    status, out = _post(url + "/v1/completions/render", {"model": "target", "prompt": [[5, 6, 7], [8, 9]]})
    assert status == 200 and [o["token_ids"] for o in out] == [[5, 6, 7], [8, 9]]
    chat = [{"role": "user", "content": "hello world"}]
    status, one = _post(url + "/v1/chat/completions/render", {"model": "target", "messages": chat})
    assert status == 200 and one["token_ids"] == _post(url + "/tokenize", {"messages": chat})[1]["tokens"]
    # refused exactly as the completion itself would be
    bad = {"model": "target", "prompt": "x", "max_tokens": 5, "temperature": -1}
    rendered, completed = _post(url + "/v1/completions/render", bad), _post(url + "/v1/completions", bad)
    assert rendered == completed and rendered[0] == 400 and rendered[1]["error"]["param"] == "temperature"
    assert _post(url + "/v1/completions/render", {"model": "other", "prompt": "x"})[0] == 404


def test_load_and_liveness_in_the_routers_shapes(replicas):
    load = _get(replicas[0].url + "/get_load")
    assert load == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    assert _get(replicas[0].url + "/live") == {"status": "ok", "draining": False}


def test_the_router_streams_the_replicas_own_tokens_from_both(replicas, router):
    """Twelve concurrent streamed completions through the router: each equals the same request
    sent to a replica directly, and both replicas served some."""
    prompts = _prompts(12)
    direct = openai.OpenAI(base_url=replicas[0].url + "/v1", api_key="none", max_retries=0)
    want = [
        direct.completions.create(model="target", prompt=p, max_tokens=16, temperature=0).choices[0].text
        for p in prompts
    ]
    before = [_metric(r.metrics(), "vllm:request_success_total") for r in replicas]
    got: list = [None] * len(prompts)

    def one(i: int) -> None:
        stream = router.client().completions.create(
            model="target", prompt=prompts[i], max_tokens=16, temperature=0, stream=True
        )
        got[i] = "".join(c.choices[0].text for c in stream if c.choices)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    assert got == want
    served = [_metric(r.metrics(), "vllm:request_success_total") - b for r, b in zip(replicas, before)]
    assert sum(served) == len(prompts) and min(served) >= 1, served


def test_a_stream_closed_at_the_router_is_aborted_on_its_replica(replicas, router):
    """The client hangs up after three chunks: the router drops its upstream connection and the
    replica aborts the request (counted as cancelled), freeing its slot long before 232 tokens."""
    before = sum(_metric(r.metrics(), "jaxserve_requests_total", outcome="cancelled") for r in replicas)
    stream = router.client().completions.create(
        model="target",
        prompt=_prompts(1, 16)[0],
        max_tokens=232,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        cancelled = sum(_metric(r.metrics(), "jaxserve_requests_total", outcome="cancelled") for r in replicas)
        if cancelled == before + 1 and all(_get(r.url + "/get_load")[0]["num_reqs"] == 0 for r in replicas):
            break
        time.sleep(0.1)
    assert cancelled == before + 1


def test_a_replica_killed_mid_run(replicas, router):
    """SIGKILL one replica while streams run on both: a stream it was serving ends early (the
    router cannot move a started stream), none on the survivor is disturbed, and every request
    sent afterwards completes on the survivor (vllm-router retries a failed connection on
    another worker). Runs last: it kills a replica of the module's pair."""
    prompts = _prompts(6, 30)
    results: list = [None] * len(prompts)
    started = threading.Barrier(len(prompts) + 1, timeout=120)

    def one(i: int) -> None:
        n = 0
        try:
            stream = router.client().completions.create(
                model="target",
                prompt=prompts[i],
                max_tokens=200,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for c in stream:
                n += 1
                if n == 1:
                    started.wait()
            results[i] = n
        except (openai.APIError, openai.APIConnectionError) as e:
            results[i] = e
            if n == 0:
                started.abort()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    [t.start() for t in threads]
    started.wait()  # every stream has its first token, on one replica or the other
    victim, survivor = replicas[1], replicas[0]
    victim.proc.kill()
    victim.proc.wait(10)
    [t.join(120) for t in threads]
    complete = [isinstance(r, int) and r >= 200 for r in results]
    assert 0 < sum(complete) < len(prompts), results  # the survivor's streams finish, the victim's do not
    after = [router.client().completions.create(model="target", prompt=p, max_tokens=8, temperature=0) for p in prompts]
    assert [len(a.choices[0].text) > 0 and a.usage.completion_tokens == 8 for a in after] == [True] * len(prompts)
    assert survivor.proc.poll() is None
