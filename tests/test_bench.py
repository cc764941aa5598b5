"""`jaxserve bench`: the workload loader (seeded, fresh ids per round, JSON files and their
errors), the statistics against numpy, the A/B runner's order and ratios, and two runs end to
end through the CLI on the small model: `bench serve` against a real server on 127.0.0.1 and
`bench throughput` offline. The oracle of the runs is the workload itself: greedy with EOS
ignored, every request must come back with exactly its prompt and output token counts."""

from __future__ import annotations

import asyncio
import json
import math
import os
import threading

import numpy as np
import pytest
from conftest import TEST_MODEL

from jaxserve import cli
from jaxserve.tools.bench import ab
from jaxserve.tools.bench.stats import RequestRecord, RequestTimer, RoundStats, summarize
from jaxserve.tools.bench.workload import Workload, WorkloadSpec

OPTS = dict(max_slots=4, page_size=8, max_model_len=128, num_pages=128, token_buckets=(16, 32))


@pytest.fixture(scope="module")
def opts(tmp_path_factory) -> dict:
    """The engine options of both runs; the second engine loads the first one's compiled steps."""
    return {**OPTS, "compilation_cache_dir": str(tmp_path_factory.mktemp("executables"))}


def run(argv, capsys) -> tuple[int, str, str]:
    code = cli.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


# -- the workload loader -------------------------------------------------------------------------


def test_random_workload_is_seeded_and_fresh_every_round():
    spec = WorkloadSpec(num_requests=12, prompt_len=(4, 40), output_len=(2, 9), seed=7, token_range=(3, 500))
    a, b = Workload.load(spec), Workload.load(spec)
    assert [r.prompt for r in a.round(0)] == [r.prompt for r in b.round(0)]  # seeded
    r0, r1 = a.round(0), a.round(1)
    assert [(r.prompt_len, r.output_len) for r in r0] == [(r.prompt_len, r.output_len) for r in r1]
    assert all(x.prompt[:4] != y.prompt[:4] for x, y in zip(r0, r1))  # no prefix survives into round 1
    assert all(4 <= r.prompt_len <= 40 and 2 <= r.output_len <= 9 for r in r0)
    assert all(3 <= t < 500 for r in r0 for t in r.prompt)
    other = Workload.load(WorkloadSpec(num_requests=12, prompt_len=(4, 40), seed=8, token_range=(3, 500)))
    assert [r.prompt for r in other.round(0)] != [r.prompt for r in r0]


def test_shared_prefix_and_long_short():
    wl = Workload.load(WorkloadSpec(kind="shared-prefix", num_requests=5, prompt_len=(3, 3), prefix_len=20))
    r0, r1 = wl.round(0), wl.round(1)
    assert all(r.prompt[:20] == r0[0].prompt[:20] and r.prompt_len == 23 for r in r0)
    assert len({tuple(r.prompt[20:]) for r in r0}) == 5 and r1[0].prompt[:20] != r0[0].prompt[:20]
    spec = WorkloadSpec(kind="long-short", num_requests=20, prompt_len=(48, 256), long_len=(1200, 1800))
    lens = [r.prompt_len for r in Workload.load(spec).round(0)]
    assert sum(n >= 1200 for n in lens) == 5 and all(48 <= n <= 256 or 1200 <= n <= 1800 for n in lens)
    text = Workload.load(WorkloadSpec(num_requests=3, prompt_len=(5, 5), text=True)).round(0)
    assert all(isinstance(r.prompt, str) and len(r.prompt.split()) == 5 for r in text)


def test_prefix_groups():
    spec = WorkloadSpec(kind="prefix-groups", num_requests=12, num_groups=3, prompt_len=(4, 4), prefix_len=10)
    wl = Workload.load(spec)
    r0, r1 = wl.round(0), wl.round(1)
    heads = [tuple(r.prompt[:10]) for r in r0]
    assert len(set(heads)) == 3 and sorted(heads.count(h) for h in set(heads)) == [4, 4, 4]
    assert [heads.index(h) for h in heads] != sorted(heads.index(h) for h in heads)  # interleaved, not in blocks
    assert all(r.prompt_len == 14 for r in r0) and len({tuple(r.prompt[10:]) for r in r0}) == 12
    assert not set(heads) & {tuple(r.prompt[:10]) for r in r1}  # every round its own prefixes
    assert wl.groups == Workload.load(spec).groups  # the same groups each load (seeded)
    assert wl.describe()["num_groups"] == 3 and wl.describe()["total_prompt_tokens"] == 12 * 14
    with pytest.raises(ValueError, match="num_groups"):
        Workload.load(WorkloadSpec(kind="prefix-groups", num_groups=0))


def test_json_workload_round0_is_the_file_then_fresh_ids(tmp_path):
    f = tmp_path / "w.json"
    f.write_text(
        json.dumps(
            {
                "vocab_size": 300,
                "requests": [{"prompt_ids": [5, 6, 7], "output_len": 4}, {"prompt": "hello there", "output_len": 2}],
            }
        )
    )
    wl = Workload.load(WorkloadSpec(kind="json", path=str(f)))
    assert [(r.prompt, r.output_len) for r in wl.round(0)] == [([5, 6, 7], 4), ("hello there", 2)]
    r1 = wl.round(1)
    assert len(r1[0].prompt) == 3 and r1[0].prompt != [5, 6, 7] and all(3 <= t < 300 for t in r1[0].prompt)
    assert r1[1].prompt == "1 hello there"  # a different first token: no prefix-cache hit
    assert wl.describe()["total_output_tokens"] == 6 and wl.spec.num_requests == 2


@pytest.mark.parametrize(
    "requests, field",
    [
        ([{"prompt_ids": [5], "output_len": 1}, {"prompt_ids": [5], "output_len": -1}], "requests[1].output_len"),
        ([{"output_len": 3}], "requests[0].prompt_ids"),
        ([{"prompt_ids": [1, "x"], "output_len": 3}], "requests[0].prompt_ids"),
        ([], "requests:"),
    ],
)
def test_json_workload_errors_name_the_field(tmp_path, requests, field):
    f = tmp_path / "w.json"
    f.write_text(json.dumps({"requests": requests}))
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        Workload.load(WorkloadSpec(kind="json", path=str(f)))


def test_spec_validation_names_the_field():
    with pytest.raises(ValueError, match="prompt_len"):
        Workload.load(WorkloadSpec(prompt_len=(9, 3)))
    with pytest.raises(ValueError, match="long_fraction"):
        Workload.load(WorkloadSpec(kind="long-short", long_fraction=1.5))


# -- statistics and the A/B runner ----------------------------------------------------------------


def test_summaries_match_numpy_percentiles():
    xs = np.random.default_rng(0).exponential(0.05, 257)
    s = summarize(xs)
    for q in (50, 90, 99):
        assert s[f"p{q}"] == pytest.approx(np.percentile(xs, q), rel=1e-12)
    assert (s["count"], s["max"], s["mean"]) == (257, pytest.approx(xs.max()), pytest.approx(xs.mean()))
    assert summarize([])["count"] == 0 and math.isnan(summarize([])["p50"])


def test_request_timer_definitions():
    t = RequestTimer()
    t.sent(10.0)
    for when, n in ((10.5, 1), (10.6, 0), (10.7, 1), (11.0, 2)):  # a chunk without tokens is no arrival
        t.chunk(n, when)
    r = t.done(prompt_tokens=7, t=11.0)
    assert (r.output_tokens, r.ttft_s, r.e2e_s) == (4, pytest.approx(0.5), pytest.approx(1.0))
    assert r.itl_s == pytest.approx([0.2, 0.3]) and r.tpot_s == pytest.approx(0.5 / 3)
    recs = [RequestRecord(7, 4, 0.5, 1.0, [0.2, 0.3]), RequestRecord(3, 2, 0.1, 0.4, [0.3])]
    s = RoundStats(2.0, recs + [RequestRecord(1, 0, math.nan, 0.1, [], "HTTP 400")]).summary()
    assert (s["completed"], s["failed"], s["output_tokens"], s["prompt_tokens"]) == (2, 1, 6, 10)
    assert s["output_tok_s"] == 3.0 and s["total_tok_s"] == 8.0
    assert s["itl_s"]["p50"] == pytest.approx(np.percentile([0.2, 0.3, 0.3], 50))


def test_ab_rounds_alternate_and_ratios_are_against_the_first():
    calls = []

    def one(c, k):
        calls.append((c, k))
        return RoundStats(1.0 + c + k, [RequestRecord(1, 10, 0.1, 0.5, [0.04])])  # B is slower than A

    res = ab.run_ab([ab.Config("A", {}), ab.Config("B", {})], one, 3, out=open("/dev/null", "w"))
    assert calls == [(0, 0), (1, 0), (1, 1), (0, 1), (0, 2), (1, 2)]
    assert res[0]["median"]["output_tok_s"] == 10 / 2.0 and res[1]["median"]["output_tok_s"] == 10 / 3.0
    assert res[1]["ratio_vs_first"]["output_tok_s"] == pytest.approx(2.0 / 3.0)
    assert "ratio_vs_first" not in res[0] and len(res[1]["rounds"]) == 3


def test_bad_arguments_exit_2_with_usage(capsys, tmp_path):
    code, _, err = run(["bench", "throughput", "--engine-opts", "{nope"], capsys)
    assert code == 2 and "usage: jaxserve bench throughput" in err and "--engine-opts: not JSON" in err
    code, _, err = run(["bench", "serve", "--base-url", "http://127.0.0.1:1", "--rate", "0"], capsys)
    assert code == 2 and "--rate: must be > 0" in err
    f = tmp_path / "w.json"
    f.write_text(json.dumps({"requests": [{"prompt_ids": [3], "output_len": 0}]}))
    code, _, err = run(["bench", "throughput", "--workload-file", str(f)], capsys)  # before any model loads
    assert code == 2 and "jaxserve bench throughput: error: requests[0].output_len" in err
    code, _, err = run(["bench", "serve", "--base-url", "ftp://x"], capsys)
    assert code == 2 and "error: base_url" in err


# -- end to end on the small model -----------------------------------------------------------------


def _check_runs(doc: dict, wl: Workload, rounds: int) -> None:
    """Every request: its workload's token counts, positive latencies, one gap per later token."""
    (cfg,) = doc["configs"]
    assert len(cfg["rounds"]) == rounds
    for k, rnd in enumerate(cfg["rounds"]):
        reqs = wl.round(k)
        assert (rnd["completed"], rnd["failed"]) == (len(reqs), 0)
        assert rnd["output_tokens"] == sum(r.output_len for r in reqs)
        for want, got in zip(reqs, rnd["requests"]):
            assert (got["prompt_tokens"], got["output_tokens"]) == (want.prompt_len, want.output_len)
            assert got["ttft_s"] > 0 and got["e2e_s"] > got["ttft_s"] and got["tpot_s"] > 0
            assert len(got["itl_s"]) == want.output_len - 1 and all(g > 0 for g in got["itl_s"])
        for m in ("ttft_s", "itl_s", "tpot_s", "e2e_s"):
            assert 0 < rnd[m]["p50"] <= rnd[m]["p90"] <= rnd[m]["p99"] <= rnd[m]["max"]
    assert cfg["median"]["output_tok_s"] > 0


def test_bench_serve_against_a_real_server(capsys, tmp_path, opts):
    from jaxserve import LLM
    from jaxserve.serving.server import Server

    llm = LLM(TEST_MODEL, **opts)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    server = Server(llm, port=None, http_port=0)
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(60)
    try:
        out = tmp_path / "serve.json"
        flags = ["--num-requests", "6", "--prompt-len", "4-20", "--output-len", "3-8", "--vocab-size", "4096"]
        argv = ["bench", "serve", "--base-url", f"http://127.0.0.1:{server.http_port}/v1", "--rate", "30", *flags]
        before = llm.stats()
        code, stdout, err = run(argv + ["--seed", "3", "--out", str(out)], capsys)
        assert code == 0, err
        doc = json.loads(out.read_text())
        assert (doc["schema"], doc["bench"], doc["workload"]["rate"]) == ("jaxserve.bench/1", "serve", 30.0)
        assert doc["configs"][0]["spec"]["model"] == "target"  # from /v1/models
        spec = WorkloadSpec(num_requests=6, prompt_len=(4, 20), output_len=(3, 8), seed=3, token_range=(3, 4096))
        _check_runs(doc, Workload.load(spec), rounds=1)
        assert "round 0: 6/6 ok" in stdout
        assert llm.stats()["kv_pages_active"] == 0  # every request finished on the server
        # prefix groups, the server as its own replica: the round's counts are the engine's own
        groups = ["--workload", "prefix-groups", "--num-groups", "2", "--prefix-len", "16", "--no-warmup"]
        metrics = ["--replica-metrics", f"http://127.0.0.1:{server.http_port}"]
        before = llm.stats()
        code, stdout, err = run(argv + groups + metrics + ["--out", str(out)], capsys)
        assert code == 0, err
        after, rep = llm.stats(), json.loads(out.read_text())["configs"][0]["rounds"][0]["extra"]["replicas"]
        assert rep["requests_per_replica"] == [6]
        assert rep["queried_tokens"] == after["prefix_cache_queried_tokens"] - before["prefix_cache_queried_tokens"]
        assert rep["hit_tokens"] == after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
        assert "median prefix-cache hit rate" in stdout
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)


def test_bench_throughput_offline(capsys, tmp_path, opts):
    out = tmp_path / "tp.json"
    flags = ["--num-requests", "4", "--prompt-len", "4-20", "--output-len", "2-6", "--rounds", "2"]
    argv = ["bench", "throughput", "--model", str(TEST_MODEL), "--engine-opts", json.dumps(opts), *flags]
    code, stdout, err = run(argv + ["--out", str(out)], capsys)
    assert code == 0, err
    doc = json.loads(out.read_text())
    assert doc["bench"] == "throughput" and doc["host"]["backend"] == "cpu"
    spec = WorkloadSpec(num_requests=4, prompt_len=(4, 20), output_len=(2, 6), token_range=(3, 4096))
    _check_runs(doc, Workload.load(spec), rounds=2)
    assert all(r["extra"]["compiles_since_warmup"] == 0 for r in doc["configs"][0]["rounds"])


def test_bench_kernels_ragged_steps(capsys, tmp_path):
    """`bench kernels` on the CPU: every decode and ragged-step cell agrees with the jnp oracle
    (its max_abs_diff), the ragged cells count their tokens' bytes and FLOPs, and a bad
    --ragged-steps item exits 2 naming the field."""
    out = tmp_path / "k.json"
    argv = ["bench", "kernels", "--rows", "2", "--contexts", "40", "--reps", "1", "--ragged-steps", "3x50+17,0x0+9@30"]
    code, stdout, err = run(argv + ["--out", str(out)], capsys)
    assert code == 0, err
    doc = json.loads(out.read_text())
    ragged = [m for m in doc["measurements"] if m["name"] == "ragged step"]
    assert {m["impl"] for m in ragged} == {"native", "xla"} and len(ragged) == 4
    assert all(m["max_abs_diff"] < 1e-5 and m["ms"] > 0 for m in doc["measurements"])
    first = next(m for m in ragged if m["config"]["decode_rows"] == 3)
    # 3 rows x 50 keys + a fresh 17-token prompt (causal: 1 + ... + 17 keys), 8 heads of 64, float32
    assert first["flops"] == 4 * 8 * 64 * (3 * 50 + 17 * 18 // 2)
    assert first["bytes"] == 2 * (3 * 50 + 17) * 4 * 64 * 4 + 2 * (3 + 17) * 8 * 64 * 4
    code, _, err = run(["bench", "kernels", "--ragged-steps", "2x0+5"], capsys)
    assert code == 2 and "ragged_steps" in err


def test_bench_kernels_matmul(capsys, tmp_path):
    """`bench kernels --matmul`: the native projection kernel and XLA's dot agree with the
    float32 oracle at every row count, each cell counts the weights' bytes once (plus x and y)
    and 2 M K N FLOPs, and a bad shape exits 2 naming the field."""
    out = tmp_path / "k.json"
    argv = ["bench", "kernels", "--rows", "1", "--contexts", "16", "--reps", "1", "--ragged-steps", "0x0+4"]
    code, _, err = run(argv + ["--matmul", "40x70", "--matmul-rows", "1,3", "--out", str(out)], capsys)
    assert code == 0, err
    cells = [m for m in json.loads(out.read_text())["measurements"] if m["name"] == "projection matmul"]
    assert sorted((m["impl"], m["config"]["rows"]) for m in cells) == [
        ("native", 1),
        ("native", 3),
        ("xla", 1),
        ("xla", 3),
    ]
    for m in cells:
        rows = m["config"]["rows"]
        assert m["max_abs_diff"] < 1e-4 and m["ms"] > 0 and m["config"]["weight_copies"] >= 2
        assert m["bytes"] == 40 * 70 * 4 + rows * (40 + 70) * 4 and m["flops"] == 2 * rows * 40 * 70
    code, _, err = run(["bench", "kernels", "--matmul", "40by70"], capsys)
    assert code == 2 and "matmul" in err


def test_bench_structured_validate_and_throughput(capsys, tmp_path, opts):
    """`bench structured`: --validate checks a mixed batch with the constraints' own oracle
    (jsonschema, re.fullmatch) and the unconstrained rows against their runs alone; the
    throughput run alternates unconstrained and half-constrained rounds on the same prompts, the
    unconstrained rounds making exactly their budget (EOS ignored) and the constrained rows
    stopping when their JSON is whole."""
    eng = json.dumps({**opts, "max_model_len": 256, "token_buckets": [16, 32, 64]})
    base = ["bench", "structured", "--model", str(TEST_MODEL), "--engine-opts", eng, "--batch", "4"]
    code, stdout, err = run(base + ["--validate", "12"], capsys)
    assert code == 0, err
    assert ", 0 invalid;" in stdout and ", 0 differ from their run alone" in stdout
    out = tmp_path / "s.json"
    code, stdout, err = run(
        base + ["--num-requests", "4", "--output-len", "40", "--rounds", "2", "--out", str(out)], capsys
    )
    assert code == 0, err
    doc = json.loads(out.read_text())
    plain, half = doc["configs"]
    assert [c["label"] for c in doc["configs"]] == ["unconstrained", "half-constrained"]
    assert all(r["output_tokens"] == 4 * 40 and r["completed"] == 4 for r in plain["rounds"])
    assert all(r["completed"] == 4 and r["output_tokens"] < 4 * 40 for r in half["rounds"])
    assert doc["summary"]["grammar_mask_ms_per_step"] > 0 and doc["summary"]["throughput_ratio"] > 0


def test_bench_quality_loss_is_transformers_and_agreement_is_against_the_first(capsys, tmp_path, opts):
    """`bench quality`: the float32 engine's held-out loss (from its prompt logprobs) is the
    cross-entropy transformers computes on the same windows; an int8 KV cache moves it by a
    fraction of a percent; greedy agreement is counted against the first configuration (itself:
    every token)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jaxserve.tools.bench import quality

    text = tmp_path / "held.txt"
    text.write_text((TEST_MODEL.parents[3] / "jaxserve" / "tools" / "bench" / "ab.py").read_text())
    f32 = {**opts, "dtype": "float32", "matmul_dtype": "float32"}
    argv = ["bench", "quality", "--model", str(TEST_MODEL), "--engine-opts", json.dumps(f32)]
    argv += ["--engine-opts", json.dumps({**f32, "kv_cache_dtype": "int8"}), "--text", str(text)]
    argv += ["--windows", "3", "--seq-len", "40", "--num-prompts", "3", "--prompt-len", "12", "--output-len", "6"]
    out = tmp_path / "q.json"
    code, stdout, err = run(argv + ["--out", str(out)], capsys)
    assert code == 0, err
    first, int8 = (c["quality"] for c in json.loads(out.read_text())["configs"])
    wins = quality.windows(AutoTokenizer.from_pretrained(TEST_MODEL), [text.read_text()], 40, 3)
    hf = AutoModelForCausalLM.from_pretrained(TEST_MODEL, torch_dtype=torch.float32)
    with torch.no_grad():
        ids = torch.tensor(wins)
        logits = hf(ids[:, :-1]).logits
        want = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    assert abs(first["heldout_loss"] - float(want)) < 1e-4
    assert first["identical_completions"] == "3/3" and first["token_agreement"] == 1.0
    assert abs(int8["loss_vs_first"]) < 0.01 and 0 <= int8["token_agreement"] <= 1
    assert first["compiles_since_warmup"] == int8["compiles_since_warmup"] == 0


def test_bench_startup_cold_compiles_and_warm_loads(capsys, tmp_path):
    """`bench startup`: the cold start (empty caches) compiles every step it warms up and loads
    none; the warm start loads exactly those and compiles none, and both print a first token."""
    gin = ["ServeConfig.max_slots = 2", "ServeConfig.max_model_len = 64", "ServeConfig.token_buckets = (16,)"]
    argv = ["bench", "startup", "--model", str(TEST_MODEL), "--rounds", "1", "--out", str(tmp_path / "s.json")]
    code, stdout, err = run(argv + [a for g in gin for a in ("--gin_param", g)], capsys)
    assert code == 0, err
    cold, warm = (c["rounds"][0] for c in json.loads((tmp_path / "s.json").read_text())["configs"])
    assert cold["compiled"] > 0 and cold["loaded"] == 0
    assert (warm["loaded"], warm["compiled"]) == (cold["compiled"], 0)
    assert 0 < cold["first_token_s"] < cold["process_s"] and 0 < warm["first_token_s"] < warm["process_s"]


def test_bench_throughput_poisson_arrivals(capsys, tmp_path, opts):
    """`bench throughput --rate`: requests enter the engine at bench serve's Poisson schedule (so a
    round lasts past its last arrival) and are timed from their arrival; each still makes
    exactly its workload's tokens."""
    from jaxserve.tools.bench.serve import arrival_gaps

    out = tmp_path / "tp.json"
    flags = ["--num-requests", "4", "--prompt-len", "4-20", "--output-len", "2-6", "--rounds", "1", "--rate", "8"]
    argv = ["bench", "throughput", "--model", str(TEST_MODEL), "--engine-opts", json.dumps(opts), *flags]
    code, _, err = run(argv + ["--seed", "5", "--out", str(out)], capsys)
    assert code == 0, err
    doc = json.loads(out.read_text())
    spec = WorkloadSpec(num_requests=4, prompt_len=(4, 20), output_len=(2, 6), seed=5, token_range=(3, 4096))
    _check_runs(doc, Workload.load(spec), rounds=1)
    assert doc["configs"][0]["rounds"][0]["wall_s"] > arrival_gaps(4, 8.0, 5).sum()
    code, _, err = run(argv + ["--vllm-python", "/nonexistent/python"], capsys)
    assert code == 2 and "vllm_python: /nonexistent/python is not a file" in err


def test_bench_profile_accounts_the_step_by_op(capsys, tmp_path):
    """`bench profile`: the traced decode step's op kinds add up to all of its op time, the native
    matmul shows under its custom-call target, and each listed op's kind is one of the kinds."""
    from pallas_kernels import native

    out = tmp_path / "p.json"
    argv = ["bench", "profile", "--model", str(TEST_MODEL), "--batch", "2", "--context", "16", "--steps", "2"]
    code, stdout, err = run(argv + ["--top", "5", "--out", str(out)], capsys)
    assert code == 0, err
    rows = json.loads(out.read_text())["measurements"]
    kinds = {r["config"]["kind"]: r for r in rows if r["name"] == "op kind"}
    ops = [r for r in rows if r["name"] == "op"]
    assert abs(sum(r["share"] for r in kinds.values()) - 1) < 1e-9 and all(r["ms"] > 0 for r in rows)
    assert len(ops) == 5 and {r["config"]["kind"] for r in ops} <= set(kinds)
    if native.available():
        assert any(k.startswith("jaxserve_matmul") for k in kinds), sorted(kinds)


def test_every_subcommand_has_help_and_lm_eval_checks_its_tasks(capsys, tmp_path):
    from jaxserve.tools.bench.commands import SUBCOMMANDS

    for name in SUBCOMMANDS:
        code, stdout, _ = run(["bench", name, "--help"], capsys)
        assert code == 0 and f"usage: jaxserve bench {name}" in stdout
    code, _, err = run(["bench", "lm-eval", "--tasks", str(tmp_path)], capsys)
    assert code == 2 and "jaxserve bench lm-eval: error: tasks: no jaxserve_mc.yaml" in err


@pytest.mark.skipif(
    not os.environ.get("JAXSERVE_VLLM_PYTHON"),
    reason="needs vLLM's venv: JAXSERVE_VLLM_PYTHON=/tmp/vllm-venv/bin/python",
)
def test_bench_throughput_beside_vllm(capsys, tmp_path, opts):
    """`bench throughput --vllm-python`: vLLM's offline engine, in its own venv's process, runs the
    same rounds alternating with jaxserve, and makes exactly the workload's tokens too."""
    out = tmp_path / "v.json"
    flags = ["--num-requests", "4", "--prompt-len", "4-20", "--output-len", "2-6", "--rounds", "2"]
    argv = ["bench", "throughput", "--model", str(TEST_MODEL), "--engine-opts", json.dumps(opts), *flags]
    vllm = [
        "--vllm-python",
        os.environ["JAXSERVE_VLLM_PYTHON"],
        "--vllm-opts",
        '{"dtype": "float32", "max_model_len": 128}',
    ]
    code, _, err = run(argv + vllm + ["--out", str(out)], capsys)
    assert code == 0, err
    ours, theirs = json.loads(out.read_text())["configs"]
    want = sum(r.output_len for r in Workload.load(WorkloadSpec(num_requests=4, prompt_len=(4, 20),
                                                                 output_len=(2, 6), token_range=(3, 4096))).round(0))  # fmt: skip
    assert theirs["label"].startswith("vllm") and theirs["rounds"][0]["output_tokens"] == want
    assert all(r["completed"] == 4 for r in theirs["rounds"]) and theirs["median"]["output_tok_s"] > 0


def test_bench_throughput_beside_another_checkout(capsys, tmp_path, opts):
    """`bench throughput --baseline-checkout`: jaxserve from a checkout (here this one) in a worker
    process runs the same rounds, alternating with the in-process LLM, and makes exactly the
    workload's tokens; a bad --vllm-python exits 2 before any model loads."""
    from pathlib import Path

    out = tmp_path / "b.json"
    flags = ["--num-requests", "4", "--prompt-len", "4-20", "--output-len", "2-6", "--rounds", "2"]
    argv = ["bench", "throughput", "--model", str(TEST_MODEL), "--engine-opts", json.dumps(opts), *flags]
    code, _, err = run(argv + ["--baseline-checkout", str(Path(cli.__file__).parents[1]), "--out", str(out)], capsys)
    assert code == 0, err
    ours, theirs = json.loads(out.read_text())["configs"]
    wl = Workload.load(WorkloadSpec(num_requests=4, prompt_len=(4, 20), output_len=(2, 6), token_range=(3, 4096)))
    for k, rnd in enumerate(theirs["rounds"]):
        assert (rnd["completed"], rnd["output_tokens"]) == (4, sum(r.output_len for r in wl.round(k)))
        assert rnd["prompt_tokens"] == ours["rounds"][k]["prompt_tokens"] and rnd["extra"]["engine"] == "jaxserve"
    assert theirs["label"].startswith("checkout ") and theirs["median"]["output_tok_s"] > 0


def test_bench_kernels_moe(capsys, tmp_path):
    """`bench kernels --moe`: the native grouped matmul (float32 and int8 panels) and the XLA path
    agree with the float32 oracle (int8 within its rounding), each cell counts the chosen experts'
    weights once, as stored, plus x and y; a bad layer exits 2 naming the field."""
    out = tmp_path / "k.json"
    argv = ["bench", "kernels", "--rows", "1", "--contexts", "16", "--reps", "1", "--ragged-steps", "0x0+4"]
    code, _, err = run(argv + ["--moe", "4x16x8:2", "--moe-tokens", "1,5", "--out", str(out)], capsys)
    assert code == 0, err
    cells = [m for m in json.loads(out.read_text())["measurements"] if m["name"] == "moe experts"]
    assert sorted((m["impl"], m["config"]["tokens"]) for m in cells) == [
        (impl, t) for impl in ("native-float32", "native-int8", "xla-float32") for t in (1, 5)
    ]
    for m in cells:
        c = m["config"]
        per_expert = {"native-float32": 1 * 16 * 64 * 4 + 1 * 8 * 64 * 4, "xla-float32": 3 * 16 * 8 * 4}.get(
            m["impl"],
            16 * 64 + 8 * 64 + 2 * 64 * 4,  # int8 panels and their scales
        )
        assert c["experts_touched"] == (2 if c["tokens"] == 1 else c["experts_touched"]) >= 2
        assert m["bytes"] == per_expert * c["experts_touched"] + c["tokens"] * 2 * 16 * 4 * 2
        assert m["max_abs_diff"] < (1e-2 if m["impl"] == "native-int8" else 1e-5) and m["ms"] > 0
    code, _, err = run(["bench", "kernels", "--moe", "4x16:2"], capsys)
    assert code == 2 and "moe" in err
