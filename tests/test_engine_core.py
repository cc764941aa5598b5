"""EngineCore's request bookkeeping on the small test model: completion ids that collide with a
client's own ids (and EngineClient's routes when the core refuses one), and the finish reason of
a stop string the last allowed token completes."""

from __future__ import annotations

import pytest
from conftest import TEST_MODEL

from jaxserve.engine.core import EngineCore
from jaxserve.engine.loading import load_engine
from jaxserve.engine.request import SamplingParams

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def core():
    return load_engine(
        TEST_MODEL, warmup=False, max_slots=4, page_size=8, max_model_len=128, num_pages=64, token_buckets=(16, 32)
    )


def _drain(core: EngineCore) -> list:
    outs = []
    for _ in range(200):
        if not core.has_unfinished():
            break
        outs += core.step()
    assert not core.has_unfinished()
    return outs


def _run(core: EngineCore, prompt, params: SamplingParams, request_id: str | None = None) -> list:
    core.add(core.make_sequence(prompt, params, request_id))
    return _drain(core)


def test_a_completion_id_already_in_use_is_refused_and_the_engine_keeps_serving(core):
    """Completion 1 of "x" is "x#1": with a client's own "x#1" live, two sequences had that id
    and a KeyError in the step ended the engine loop."""
    core.add(core.make_sequence([5, 6, 7], SamplingParams(max_tokens=2, **GREEDY), "x#1"))
    with pytest.raises(ValueError, match=r"request_id: 'x#1' is already in use"):
        core.add(core.make_sequence([5, 6, 7], SamplingParams(max_tokens=6, n=2, **GREEDY), "x"))
    outs = _drain(core)
    assert {(o.request_id, o.index) for o in outs} == {("x#1", 0)}
    assert sum(len(o.token_ids) for o in outs) == 2 and outs[-1].finish_reason == "length"
    # the other way round: "x" with n=2 is live, then a client's "x#1" (or "x" again) is refused
    core.add(core.make_sequence([5, 6, 7], SamplingParams(max_tokens=6, n=2, **GREEDY), "x"))
    for rid in ("x#1", "x"):
        with pytest.raises(ValueError, match=rf"request_id: '{rid}' is already in use"):
            core.add(core.make_sequence([5, 6, 7], SamplingParams(max_tokens=2, **GREEDY), rid))
    outs = _drain(core)
    assert {o.index: o.finish_reason for o in outs if o.finished} == {0: "length", 1: "length"}
    assert {o.request_id for o in outs} == {"x"}
    # a finished request's ids are free again
    assert len(_run(core, [5, 6, 7], SamplingParams(max_tokens=2, **GREEDY), "x#1")) >= 1
    core.flush_prefix_cache()
    assert core.kv.alloc.num_free == core.kv.alloc.capacity  # every page back


def test_a_stop_string_completed_by_the_last_allowed_token_finishes_with_stop(core):
    """max_tokens is reached by the token that completes a stop string: the text ends before
    the stop string and the reason is "stop" (vLLM's), not "length"."""
    prompt, params = "def add(a, b):", dict(max_tokens=6, **GREEDY)
    ref = _run(core, prompt, SamplingParams(**params))
    ids = [t for o in ref for t in o.token_ids]
    full = "".join(o.text for o in ref)
    before = core.tokenizer.decode(ids[:-1], skip_special_tokens=True)
    stop = full[len(before) - 2 :]  # the last token's text and the two characters before it
    assert ref[-1].finish_reason == "length" and len(ids) == 6 and stop not in before
    outs = _run(core, prompt, SamplingParams(stop=[stop], **params))
    assert [t for o in outs for t in o.token_ids] == ids
    assert "".join(o.text for o in outs) == full[: -len(stop)]
    assert outs[-1].finish_reason == "stop"


def test_a_refused_submit_leaves_nothing_routed(core):
    """EngineClient routes a request before the core accepts it: when the core refuses it (a
    completion id already live), the route is removed, or the id stayed blocked for good and
    counted against the waiting queue."""
    import asyncio

    from jaxserve.engine.client import EngineClient

    client = EngineClient(core)
    client.start()

    async def go():
        first = await client.submit([5, 6, 7], SamplingParams(max_tokens=4, **GREEDY), "y#1")
        with pytest.raises(ValueError, match=r"request_id: 'y#1' is already in use"):
            await client.submit([5, 6, 7], SamplingParams(max_tokens=4, n=2, **GREEDY), "y")
        assert client.in_flight == ["y#1"]
        outs = [o async for o in first]
        assert outs[-1].finish_reason == "length" and client.in_flight == []
        again = await client.submit([5, 6, 7], SamplingParams(max_tokens=2, n=2, **GREEDY), "y")
        assert {o.index for o in [o async for o in again] if o.finished} == {0, 1}

    try:
        asyncio.run(go())
    finally:
        client.stop()
    assert client.in_flight == []
