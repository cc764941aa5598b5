"""One sampling request model for every frontend: the HTTP body, the gRPC message and the CLI's
flags of the same request give the same SamplingParams (the oracle: SamplingParams built
directly), errors name the field, and the declarations of a scalar control agree from the
request model down to the sampler's per-row array."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxserve import cli
from jaxserve.engine.request import ROW_CONTROL_FIELDS, SamplingParams
from jaxserve.engine.sampling_request import SamplingFields, to_sampling_params
from jaxserve.runner import step_batch
from jaxserve.runner.sampling import ROW_CONTROLS
from jaxserve.serving import protocol
from jaxserve.serving.client import sampling_message
from jaxserve.serving.grpc_server import sampling_fields

REQUEST = dict(
    max_tokens=7,
    temperature=0.75,  # exact in float32 (the proto's floats)
    top_p=0.875,
    top_k=5,
    n=2,
    seed=11,
    stop=["\n\n", "END"],
    stop_token_ids=[3, 4],
    presence_penalty=0.5,
    frequency_penalty=-0.25,
    repetition_penalty=1.25,
    min_p=0.125,
    min_tokens=2,
    ignore_eos=True,
    logit_bias={"17": -100.0, "23": 2.5},
)
WANT = SamplingParams(**{**REQUEST, "logit_bias": {17: -100.0, 23: 2.5}})


def _http() -> SamplingParams:
    body = protocol.CompletionRequest(model="m", prompt="hi", **REQUEST)
    return protocol.to_sampling_params(body, body.max_tokens, 16, 2048, None, {})(0)


def _grpc() -> SamplingParams:
    fields, extra = sampling_fields(sampling_message(REQUEST))
    return to_sampling_params(fields, max_tokens=fields.max_tokens, default_max=256, max_model_len=2048, **extra)(0)


def _cli() -> SamplingParams:
    argv = ["generate", "hi"]
    for name, value in REQUEST.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag)
        elif isinstance(value, dict):
            for k, v in value.items():
                argv += [flag, f"{k}={v}"]
        elif isinstance(value, list):
            for v in value:
                argv += [flag, str(v)]
        else:
            argv += [flag, str(value)]
    return cli._generate_params(cli.build_parser().parse_args(argv))  # noqa: SLF001


@pytest.mark.parametrize("frontend", [_http, _grpc, _cli], ids=["http", "grpc", "cli"])
def test_every_frontend_maps_a_request_to_the_same_params(frontend):
    assert frontend() == WANT


def test_unset_fields_take_each_frontends_defaults():
    body = protocol.ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}])
    assert protocol.to_sampling_params(body, None, 256, 100, None, {})(90) == SamplingParams(max_tokens=10)
    fields, extra = sampling_fields(sampling_message({}))  # proto3: 0 is "unset", but temperature 0 is greedy
    params = to_sampling_params(fields, max_tokens=fields.max_tokens, default_max=256, max_model_len=2048, **extra)
    assert params(0) == SamplingParams(max_tokens=256, temperature=0.0)


def test_grpc_controls_map_carries_fields_without_a_proto_field():
    msg = sampling_message({"temperature": 1.0})
    msg.controls["min_p"] = 0.25
    fields, _ = sampling_fields(msg)
    assert fields.min_p == 0.25
    msg.controls["top_z"] = 1.0
    with pytest.raises(ValueError, match="^controls: 'top_z'"):
        sampling_fields(msg)


@pytest.mark.parametrize(
    "values, field",
    [(dict(min_p=2.0), "min_p"), (dict(top_k=-3), "top_k"), (dict(logit_bias={"x": 1.0}), "logit_bias")],
)
def test_errors_name_the_field(values, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        to_sampling_params(SamplingFields.parse(values), max_tokens=4, default_max=4, max_model_len=64)
    with pytest.raises(ValueError, match="^min_tokens: "):
        SamplingFields.parse({"min_tokens": "many"})


def test_one_declaration_of_each_scalar_control():
    """The sampler's no-op values are SamplingParams' defaults, every such field is in the
    request model (and so a flag, an HTTP field and a gRPC control), and step_batch puts a
    controlled row's values in the sampler's column of that name."""
    assert ROW_CONTROLS == {f.name: f.default for f in ROW_CONTROL_FIELDS}
    assert set(ROW_CONTROLS) <= set(SamplingFields.model_fields)
    params = dataclasses.replace(WANT, n=1)
    ctl = step_batch.Controls(values=step_batch.Controls.values_of(params))
    rows = [
        step_batch.Chunk([1], 0, [1], (0.0, 0, 1.0, 0, 0)),
        step_batch.Chunk([2], 0, [2], (0.0, 0, 1.0, 0, 0), 0, ctl),
    ]
    sm = step_batch.build(rows, num_rows=2, num_tokens=2, table_width=2, page_size=4, vocab_size=32).sampling
    for name, default in ROW_CONTROLS.items():
        np.testing.assert_array_equal(getattr(sm, name), np.float32([default, getattr(params, name)]), err_msg=name)
