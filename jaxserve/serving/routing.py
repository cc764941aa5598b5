"""The endpoints that routers and orchestrators call, beside the OpenAI API.

jaxserve does not route between replicas itself: an existing router (vllm-router, sglang's
router, the Gateway API Inference Extension's endpoint picker) does, and these endpoints are
what they ask a replica (docs/scaling.md):

- ``GET /live``: liveness. 200 while the engine loop runs, also while draining (a pod being
  drained must not be restarted); 503 once the engine failed (the process then exits).
  ``GET /health`` is readiness: it also answers 503 while draining.
- ``GET /get_load``: SGLang's and vllm-router's load report, one entry per data-parallel rank
  (jaxserve has one): requests in flight, requests waiting for a slot, tokens held in KV.
  vllm-router's ``power_of_two`` policy polls it.
- ``POST /v1/completions/render`` and ``POST /v1/chat/completions/render``: vLLM's "render" of
  a request: the token ids the prompt becomes (a list, one entry per prompt, for completions;
  one object for chat) and the sampling parameters, without generating. vllm-router's
  ``cache_aware`` policy calls them on every replica for each text or chat request, so that it
  matches prefixes on the ids the replica will see (token-id prompts need nothing).
"""

import asyncio
import dataclasses
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI

from jaxserve.serving.protocol import APIError, ChatCompletionRequest, CompletionRequest, engine_error

if TYPE_CHECKING:
    from jaxserve.serving.http_server import HttpFrontend

# The probe paths the Kubernetes manifests use (jaxserve/tools/k8s.py reads them from here).
LIVENESS_PATH = "/live"
READINESS_PATH = "/health"


def load_report(in_flight: int, stats: dict, page_size: int) -> list[dict]:
    """/get_load's body: SGLang's shape (a list with one entry per data-parallel rank).

    `in_flight`: requests admitted and not finished (waiting ones included); `stats`: the
    engine's last published step statistics (EngineCore.stats)."""
    waiting = int(stats.get("waiting", 0))
    return [
        {
            "dp_rank": 0,
            "num_reqs": int(in_flight),
            "num_waiting_reqs": min(waiting, int(in_flight)),
            "num_tokens": int(stats.get("kv_pages_active", 0)) * int(page_size),
        }
    ]


def rendered_params(params) -> dict[str, Any]:
    """A request's SamplingParams as JSON: tuples as lists, logit_bias with string keys (the
    constraints stay as the request gave them: text, or a JSON Schema as canonical JSON text)."""
    out = {}
    for f in dataclasses.fields(params):
        v = getattr(params, f.name)
        out[f.name] = (
            list(v) if isinstance(v, tuple) else {str(k): b for k, b in v.items()} if isinstance(v, Mapping) else v
        )
    return out


def add_routes(app: FastAPI, frontend: "HttpFrontend") -> None:
    """The routes above on the app, over one HttpFrontend (its engine, metrics, request mapping
    and bearer-token check). No `from __future__ import annotations` here, so that FastAPI sees
    the request models themselves in the render routes' signatures."""
    auth = [Depends(frontend._authorize)]  # noqa: SLF001 - the frontend's own check, shared

    @app.get(LIVENESS_PATH)
    async def live():
        if frontend.engine.error is not None:
            raise APIError(503, f"the engine failed: {frontend.engine.error!r}", type_="service_unavailable")
        return {"status": "ok", "draining": frontend.draining}

    @app.get("/get_load", dependencies=auth)
    async def get_load():
        return load_report(len(frontend.engine.in_flight), frontend.metrics.engine_stats, frontend.page_size)

    @app.post("/v1/completions/render", dependencies=auth)
    async def render(body: CompletionRequest):
        frontend._check_model(body.model)  # noqa: SLF001 - the frontend's own check, shared
        return await _render(frontend, body)

    @app.post("/v1/chat/completions/render", dependencies=auth)
    async def render_chat(body: ChatCompletionRequest):
        frontend._check_model(body.model)  # noqa: SLF001
        call = frontend._chat_call(body)  # noqa: SLF001 - the chat template, tools and all
        return await _rendered(frontend, call, call.prompt, "chatcmpl")


async def _render(frontend: "HttpFrontend", body) -> list[dict]:
    """One entry per prompt, as vLLM's /v1/completions/render answers: the request is refused
    exactly as /v1/completions would refuse it (same mapping, same errors)."""
    call = frontend._completion_call(body)  # noqa: SLF001
    return [await _rendered(frontend, call, prompt, "cmpl") for prompt in call.prompts]


async def _rendered(frontend: "HttpFrontend", call, prompt, kind: str) -> dict:
    """One prompt (text, token ids or a chat Conversation) as the ids the engine would run."""
    try:
        if isinstance(prompt, list):
            ids = [int(t) for t in prompt]
        else:
            ids = await asyncio.get_running_loop().run_in_executor(None, frontend.engine.tokenize, prompt, True)
        params = call.params(len(ids))
    except ValueError as e:
        raise engine_error(e, call.renames) from None
    return {
        "request_id": f"{kind}-{uuid.uuid4().hex}",
        "model": frontend.model_name,
        "token_ids": ids,
        "sampling_params": rendered_params(params),
    }
