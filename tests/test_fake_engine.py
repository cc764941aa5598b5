"""The fake engine (engine/fake_engine.py) on its own: it keeps the engine contract's promises
(contract.Engine) that frontend tests rely on, and importing it never imports jax. The oracle is
the fake model's own function and the pool's invariants; that the jitted core keeps the same
promises the same way (its refusals, stats keys, model info) is tests/test_engine_contract.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import pool_whole

from jaxserve.engine.contract import STATS_KEYS, Engine, ModelInfo
from jaxserve.engine.fake_engine import EOS, FakeEngine, FakeModel
from jaxserve.engine.request import SamplingParams

pytestmark = pytest.mark.fast

OPTS = dict(max_slots=4, page_size=8, max_model_len=96, num_pages=64, token_buckets=(16, 32), step_seconds=0)


def run(engine: FakeEngine, *requests) -> dict[str, list]:
    """Add (prompt, params, id) requests and step until done: each id's outputs, in order."""
    outs: dict[str, list] = {}
    for prompt, params, rid in requests:
        engine.add(engine.make_sequence(prompt, params, rid))
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


def joined(outs) -> tuple[list[int], str, str | None]:
    return sum((o.token_ids for o in outs), []), "".join(o.text for o in outs), outs[-1].finish_reason


def test_importing_the_fake_and_the_servers_imports_no_jax():
    code = (
        "import sys; import jaxserve.engine.fake_engine, jaxserve.serving.server, jaxserve.serving.http_server; "
        "print(sorted(m for m in ('jax', 'jaxlib', 'flax', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_it_meets_the_contract():
    fake = FakeEngine(**OPTS)
    assert isinstance(fake, Engine)
    assert tuple(fake.stats()) == STATS_KEYS
    info = fake.model_info()
    assert isinstance(info, ModelInfo) and (info.context_length, info.page_size, info.num_kv_pages) == (
        96,
        8,
        63,
    )  # page 0: the dummy


def test_tokens_text_length_and_pages():
    fake = FakeEngine(**OPTS)
    outs = run(fake, ([5, 6, 7], SamplingParams(max_tokens=10), "a"), ("w9 w10", SamplingParams(max_tokens=3), "b"))
    ids, text, reason = joined(outs["a"])
    assert ids == fake.model.tokens([5, 6, 7], 10) and reason == "length"
    assert text == " ".join(f"w{t}" for t in ids)
    assert joined(outs["b"])[0] == fake.model.tokens([9, 10], 3)
    pool_whole(fake)


def test_stop_strings_are_cut_and_never_streamed_in_part():
    fake = FakeEngine(**OPTS)
    want = fake.model.tokens([5, 6, 7], 10)
    stop = f"w{want[4]} w{want[5]}"
    outs = run(fake, ([5, 6, 7], SamplingParams(max_tokens=10, stop=[stop]), "a"))["a"]
    ids, text, reason = joined(outs)
    assert reason == "stop" and text == " ".join(f"w{t}" for t in want[:4]) + " "
    assert all(stop.split()[0] not in o.text for o in outs)
    assert ids == want[:6]  # through the token that completed the stop string


def test_stop_token_ids_eos_and_ignore_eos():
    fake = FakeEngine(**OPTS)
    want = fake.model.tokens([5, 6, 7], 10)
    ids, _, reason = joined(run(fake, ([5, 6, 7], SamplingParams(max_tokens=10, stop_token_ids=[want[2]]), "a"))["a"])
    assert (ids, reason) == (want[:3], "stop")
    eos = FakeEngine(FakeModel(eos_at=4), **OPTS)
    ids, text, reason = joined(run(eos, ([5, 6, 7], SamplingParams(max_tokens=10), "a"))["a"])
    assert (ids[-1], len(ids), reason) == (EOS, 4, "stop") and "<" not in text
    ids, _, reason = joined(run(eos, ([5, 6, 7], SamplingParams(max_tokens=10, ignore_eos=True), "b"))["b"])
    assert (len(ids), reason) == (10, "length") and EOS in ids


def test_n_completions_differ_and_share_the_prompt_pages():
    fake = FakeEngine(**OPTS)
    outs = run(fake, ([5] * 20, SamplingParams(max_tokens=5, n=3), "a"))["a"]
    by_index = {i: sum((o.token_ids for o in outs if o.index == i), []) for i in range(3)}
    assert by_index == {i: fake.model.tokens([5] * 20, 5, index=i) for i in range(3)}
    assert len(set(map(tuple, by_index.values()))) == 3
    pool_whole(fake)


def test_abort_ends_every_completion_and_frees_pages():
    fake = FakeEngine(**OPTS)
    fake.add(fake.make_sequence([5] * 20, SamplingParams(max_tokens=50, n=2), "a"))
    fake.step(), fake.step()
    assert fake.num_running == 2 and fake.any_live(["a", "a#1"])
    fake.abort("a")
    outs = fake.step()
    assert sorted((o.index, o.finish_reason) for o in outs) == [(0, "abort"), (1, "abort")]
    assert not fake.has_unfinished() and not fake.any_live(["a", "a#1"])
    pool_whole(fake)


def test_logprobs_and_prompt_logprobs_have_the_cores_shape():
    fake = FakeEngine(**OPTS)
    params = SamplingParams(max_tokens=3, logprobs=2, prompt_logprobs=1)
    outs = run(fake, ([5, 6, 7], params, "a"))["a"]
    lps = sum((o.logprobs for o in outs), [])
    ids = sum((o.token_ids for o in outs), [])
    assert [next(iter(lp)) for lp in lps] == ids and all(len(lp) == 2 for lp in lps)
    assert all(lp[t] == max(lp.values()) for lp, t in zip(lps, ids))  # the chosen token is the likeliest
    assert outs[0].prompt_logprobs[0] is None and [next(iter(p)) for p in outs[0].prompt_logprobs[1:]] == [6, 7]
    assert all(o.prompt_logprobs is None for o in outs[1:])


def test_validation_names_the_field_and_a_live_id_is_refused():
    fake = FakeEngine(**OPTS)
    for prompt, params, field in (
        ([], None, "prompt"),
        ("", None, "prompt"),
        ([1, 999], None, "prompt_token_ids"),
        ([1, True], None, "prompt_token_ids[1]"),
        ([1] * 90, SamplingParams(max_tokens=10), "max_tokens"),
        ([1], SamplingParams(stop_token_ids=[600]), "stop_token_ids"),
        ([1], SamplingParams(regex="a+"), "regex"),
    ):
        with pytest.raises(ValueError, match=f"^{field.replace('[', '.').replace(']', '.')}"):
            fake.make_sequence(prompt, params)
    fake.add(fake.make_sequence([1, 2], SamplingParams(max_tokens=5, n=2), "x"))
    with pytest.raises(ValueError, match="^request_id: 'x#1'"):
        fake.add(fake.make_sequence([1, 2], None, "x#1"))


def test_prefix_cache_hits_and_stats():
    fake = FakeEngine(**OPTS)
    prompt = list(range(3, 40))
    run(fake, (prompt, SamplingParams(max_tokens=2), "a"))
    outs = run(fake, (prompt + [50], SamplingParams(max_tokens=2), "b"))["b"]
    assert outs[0].num_cached_prompt_tokens == 32  # every whole page of the first prompt
    stats = fake.stats()
    assert stats["prefix_cache_hit_tokens"] == 32 and stats["running"] == stats["waiting"] == 0
    assert fake.flush_prefix_cache() > 0 and fake.stats()["kv_pages_free"] == stats["kv_pages_total"]
