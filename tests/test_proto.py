"""The committed stubs are what scripts/gen_proto.sh makes from proto/ today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parents[1]


def test_generated_stubs_match_the_proto(tmp_path):
    subprocess.run(
        ["bash", str(REPO / "scripts" / "gen_proto.sh"), str(tmp_path)],
        check=True,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )
    for name in ("jaxserve_pb2.py", "jaxserve_pb2_grpc.py", "jaxserve_pb2.pyi"):
        fresh = (tmp_path / "jaxserve" / "v1" / name).read_text()
        assert fresh == (REPO / "jaxserve" / "v1" / name).read_text(), f"{name} is stale: run scripts/gen_proto.sh"


def test_contract_names_and_numbers():
    from jaxserve.v1 import jaxserve_pb2 as pb

    f = pb.GenerateRequest.DESCRIPTOR.fields_by_name
    assert {n: f[n].number for n in ("request_id", "text", "token_ids", "sampling")} == {
        "request_id": 1,
        "text": 2,
        "token_ids": 3,
        "sampling": 4,
    }
    s = pb.SamplingParams.DESCRIPTOR.fields_by_name
    assert [
        s[n].number
        for n in (
            "max_tokens",
            "temperature",
            "top_k",
            "top_p",
            "seed",
            "stop",
            "stop_token_ids",
            "ignore_eos",
            "logprobs",
        )
    ] == list(range(1, 10))
    r = pb.GenerateResponse.DESCRIPTOR.fields_by_name
    assert [r[n].number for n in ("request_id", "text", "token_ids", "logprobs", "finish_reason", "usage")] == list(
        range(1, 7)
    )
    assert [pb.FinishReason.Value(n) for n in ("FINISH_REASON_UNSPECIFIED", "STOP", "LENGTH", "ABORT")] == [0, 1, 2, 3]
    u = pb.Usage.DESCRIPTOR.fields_by_name
    assert [u[n].number for n in ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")] == [1, 2, 3]
    methods = {m.name for m in pb.DESCRIPTOR.services_by_name["JaxServe"].methods}
    assert methods == {"Generate", "Abort", "GetModelInfo"}
