"""A Python client for jaxserve, built on the stubs generated from proto/."""

from __future__ import annotations

from typing import Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxserve.v1 import jaxserve_pb2 as pb
from jaxserve.v1 import jaxserve_pb2_grpc as pb_grpc


def sampling_message(sampling: dict) -> pb.SamplingParams:
    """The proto SamplingParams of keyword arguments named as the shared sampling model
    (engine/sampling_request.py): logit_bias keys may be text, as in JSON; a field without a
    proto field of its own goes in the `controls` map."""
    given = dict(sampling)
    if isinstance(given.get("stop"), str):
        given["stop"] = [given["stop"]]
    if given.get("logit_bias"):
        given["logit_bias"] = {int(k): v for k, v in given["logit_bias"].items()}
    named = pb.SamplingParams.DESCRIPTOR.fields_by_name
    controls = {k: float(given.pop(k)) for k in list(given) if k not in named}  # no field of its own
    return pb.SamplingParams(**given, controls=controls)


class Client:
    def __init__(self, target: str = "127.0.0.1:50051", token: str | None = None, root_cert: bytes | None = None):
        self.channel = (
            grpc.secure_channel(target, grpc.ssl_channel_credentials(root_cert))
            if root_cert
            else grpc.insecure_channel(target)
        )
        self.stub = pb_grpc.JaxServeStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()

    def request(
        self, prompt: str | Sequence[int] | Sequence[dict], request_id: str = "", **sampling
    ) -> pb.GenerateRequest:
        """prompt: text, token ids, or chat messages ({"role", "content"} dicts, rendered by the
        server's chat template)."""
        req = pb.GenerateRequest(request_id=request_id, sampling=sampling_message(sampling))
        if isinstance(prompt, str):
            req.text = prompt
        elif prompt and isinstance(prompt[0], dict):
            req.messages.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in prompt)
        else:
            req.token_ids.ids.extend(prompt)
        return req

    def generate(
        self,
        prompt: str | Sequence[int] | Sequence[dict],
        timeout: float | None = None,
        request_id: str = "",
        **sampling,
    ) -> Iterator[pb.GenerateResponse]:
        """Stream the responses; cancel the returned iterator (`.cancel()`) to abort."""
        return self.stub.Generate(self.request(prompt, request_id, **sampling), timeout=timeout, metadata=self.metadata)

    def chat(
        self, messages: Sequence[dict], timeout: float | None = None, request_id: str = "", **sampling
    ) -> Iterator[pb.GenerateResponse]:
        """Stream the assistant's reply to a conversation: [{"role": "user", "content": "..."}, ...]."""
        return self.generate(list(messages), timeout=timeout, request_id=request_id, **sampling)

    def complete(
        self, prompt: str | Sequence[int] | Sequence[dict], **kw
    ) -> tuple[str, list[int], pb.GenerateResponse]:
        text, ids, last = "", [], None
        for r in self.generate(prompt, **kw):
            text += r.text
            ids += list(r.token_ids)
            last = r
        return text, ids, last

    def abort(self, request_id: str) -> bool:
        return self.stub.Abort(pb.AbortRequest(request_id=request_id), metadata=self.metadata).found

    def model_info(self) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.ModelInfoRequest(), metadata=self.metadata)

    def health(self, service: str = "") -> str:
        r = health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(service=service))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)

    def wait_until_serving(self, timeout: float = 120.0) -> None:
        import time

        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.health() == "SERVING":
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("jaxserve did not become SERVING in time")
            time.sleep(0.2)

    def close(self) -> None:
        self.channel.close()
