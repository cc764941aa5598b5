"""The gRPC frontend (grpc.aio): streaming Generate, Abort, GetModelInfo and bearer-token auth.
`server.Server` runs it (with health, reflection, TLS and draining) beside the HTTP frontend.

The engine runs in one thread behind an EngineClient, which hands each request's
incremental outputs to the asyncio queue of the RPC that owns it. RPC handlers never touch
arrays or the scheduler: they submit (validation and tokenization run in a worker thread),
stream and, when the client goes away, abort.
"""

from __future__ import annotations

import contextlib
import logging
import numbers
import uuid
from collections.abc import Mapping
from typing import Any

import grpc

from jaxserve.engine.chat import Conversation
from jaxserve.engine.client import EngineClient, EngineDead, QueueFull, split_logprobs
from jaxserve.engine.sampling_request import SamplingFields, to_sampling_params
from jaxserve.serving.lifecycle import RequestLife
from jaxserve.serving.metrics import Metrics
from jaxserve.v1 import jaxserve_pb2 as pb
from jaxserve.v1 import jaxserve_pb2_grpc as pb_grpc

log = logging.getLogger("jaxserve.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["JaxServe"].full_name
FINISH = {"stop": pb.STOP, "length": pb.LENGTH, "abort": pb.ABORT}


# Proto fields the shared sampling model does not hold: said the proto's own way.
_OWN = ("logprobs", "controls", "json_schema", "regex", "grammar", "json_object")


def sampling_fields(s: pb.SamplingParams) -> tuple[SamplingFields, dict[str, Any]]:
    """A proto SamplingParams as the shared sampling model, plus logprobs and the output
    constraint. In proto3 an unset number reads 0, which means "the default" for every field
    but temperature (0 is greedy): only the fields set (ListFields) are passed, and
    temperature always. `controls` carries, by name, any field of the model that has no proto
    field of its own (a new control needs no new field number)."""
    given = {f.name: v for f, v in s.ListFields()}
    extra = {name: given.pop(name) for name in _OWN if name in given}
    for name, value in extra.pop("controls", {}).items():
        if name in given or name not in SamplingFields.model_fields:
            raise ValueError(f"controls: {name!r} is not a sampling field without its own proto field")
        given[name] = value
    values = {k: _plain(v) for k, v in given.items()}
    values["temperature"] = s.temperature
    return SamplingFields.parse(values), extra


def _plain(value: Any) -> Any:
    """A proto value as JSON would give it: a map with text keys, a repeated field as a list."""
    if isinstance(value, Mapping):
        return {str(k): v for k, v in value.items()}
    if isinstance(value, (str, bytes, numbers.Number)):
        return value
    return list(value)


class JaxServeServicer(pb_grpc.JaxServeServicer):
    """gRPC requests in, engine-client calls out: validation and outputs are the engine's."""

    def __init__(self, engine: EngineClient, metrics: Metrics, default_max_tokens: int = 256):
        self.engine = engine
        self.metrics = metrics
        self.default_max_tokens = default_max_tokens
        self.max_model_len = engine.model_info().context_length
        self.draining = False

    def _params(self, req: pb.GenerateRequest):
        """The request's SamplingParams, as a function of its prompt length when max_tokens
        is unset (then: the default, or what fits in the context)."""
        fields, extra = sampling_fields(req.sampling)
        return to_sampling_params(
            fields,
            max_tokens=fields.max_tokens,
            default_max=self.default_max_tokens,
            max_model_len=self.max_model_len,
            **extra,
        )

    async def Generate(self, request, context):
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        which = request.WhichOneof("prompt")
        try:
            if which is None:
                raise ValueError("prompt: one of text, token_ids or messages is required")
            if which == "messages":  # rendered by the chat template in the engine client's worker thread
                prompt: Any = Conversation.of(
                    [{"role": m.role, "content": m.content} for m in request.messages.messages]
                )
            else:
                prompt = request.text if which == "text" else list(request.token_ids.ids)
            stream = await self.engine.submit(prompt, self._params(request), request.request_id or uuid.uuid4().hex)
        except ValueError as e:
            self.metrics.requests.labels("invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except QueueFull as e:
            self.metrics.requests.labels("rejected").inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except EngineDead as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        rid, n_prompt = stream.request_id, len(stream.prompt_token_ids)
        life = RequestLife(self.engine, self.metrics, stream)
        try:
            async with contextlib.aclosing(life.outputs()) as outputs:  # a cancelled call aborts the request
                async for out in outputs:
                    resp = pb.GenerateResponse(request_id=rid, text=out.text, token_ids=out.token_ids, index=out.index)
                    for lp in out.logprobs or []:
                        chosen, top = split_logprobs(lp, request.sampling.logprobs)
                        resp.logprobs.add(
                            token_id=chosen.token_id,
                            logprob=chosen.logprob,
                            top=[pb.TokenLogprob(token_id=t.token_id, logprob=t.logprob) for t in top],
                        )
                    if out.finished:  # this completion; the request when all n are (stream.finished)
                        resp.finish_reason = FINISH[out.finish_reason]
                        resp.usage.CopyFrom(
                            pb.Usage(
                                prompt_tokens=n_prompt,
                                completion_tokens=life.timer.completion,
                                cached_prompt_tokens=out.num_cached_prompt_tokens,
                            )
                        )
                    yield resp
        except Exception as e:  # the engine step failed
            await context.abort(grpc.StatusCode.INTERNAL, f"engine error: {e}")

    async def Abort(self, request, context):
        return pb.AbortResponse(found=self.engine.abort(request.request_id))

    async def GetModelInfo(self, request, context):
        info = self.engine.model_info()
        return pb.ModelInfo(
            model_name=info.model_name,
            context_length=info.context_length,
            vocab_size=info.vocab_size,
            features=list(info.features),
            max_slots=info.max_slots,
            page_size=info.page_size,
            num_kv_pages=info.num_kv_pages,
            has_tokenizer=info.has_tokenizer,
        )


class BearerAuth(grpc.aio.ServerInterceptor):
    """Checks `authorization: Bearer <token>` on every call except health checks."""

    def __init__(self, token: str):
        self.expected = f"Bearer {token}"

    async def intercept_service(self, continuation, details):
        if details.method.startswith("/grpc.health.v1.Health/"):
            return await continuation(details)
        md = dict(details.invocation_metadata or ())
        if md.get("authorization") == self.expected:
            return await continuation(details)

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        handler = await continuation(details)
        if handler is not None and handler.response_streaming:

            async def deny_stream(request, context):
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
                yield  # pragma: no cover

            return grpc.unary_stream_rpc_method_handler(deny_stream)
        return grpc.unary_unary_rpc_method_handler(deny)
