"""The jitted EngineCore and the FakeEngine keep the engine contract (engine/contract.py) alike:
both are a contract.Engine, report the same stats keys and model-info fields, and refuse the same
bad requests with the same message (each names the field). The fake's frontend tests
(test_*_frontend.py, test_server.py, test_http_fuzz.py) stand for the real engine only as far as
this holds."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.engine import contract
from jaxserve.engine.fake_engine import FakeEngine
from jaxserve.engine.request import SamplingParams

OPTS = dict(max_slots=2, page_size=8, max_model_len=96, num_pages=32, token_buckets=(16, 32))

BAD = [
    ([], None),
    ("", None),
    ([1, 999], None),
    ([1, True], None),
    ([1, 2.0], None),
    (np.zeros((2, 2), np.int32), None),
    ({"role": "user", "content": "x"}, None),
    ([{"role": "user", "content": "x"}], None),
    (b"abc", None),
    ([1] * 90, SamplingParams(max_tokens=10)),
    ([1], SamplingParams(stop_token_ids=[600])),
    ([1], SamplingParams(logit_bias={700: 1.0})),
    ([1], SamplingParams(min_tokens=1, stop_token_ids=tuple(range(2, 30)))),
    ([1], "not params"),
]


@pytest.fixture(scope="module")
def engines(tok_model):
    from jaxserve.engine.loading import load_engine

    return load_engine(tok_model[0], warmup=False, **OPTS), FakeEngine(**OPTS)


def test_both_are_engines_with_the_same_reports(engines):
    core, fake = engines
    assert isinstance(core, contract.Engine) and isinstance(fake, contract.Engine)
    assert tuple(core.stats()) == tuple(fake.stats()) == contract.STATS_KEYS
    real, faked = core.model_info(), fake.model_info()
    assert type(real) is type(faked) is contract.ModelInfo
    for field in ("context_length", "vocab_size", "max_slots", "page_size", "num_kv_pages", "has_tokenizer"):
        assert getattr(real, field) == getattr(faked, field), field
    assert ("prefix_caching" in real.features) == ("prefix_caching" in faked.features)
    assert contract.completion_ids("r", 3) == ["r", "r#1", "r#2"]


@pytest.mark.parametrize("prompt, params", BAD, ids=range(len(BAD)))
def test_the_same_bad_request_is_refused_with_the_same_message(engines, prompt, params):
    core, fake = engines
    with pytest.raises(ValueError) as real:
        core.make_sequence(prompt, params)
    with pytest.raises(ValueError) as faked:
        fake.make_sequence(prompt, params)
    assert str(faked.value) == str(real.value)
