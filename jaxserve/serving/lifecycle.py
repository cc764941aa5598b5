"""One request's life on the server, the same for every frontend (gRPC and HTTP).

A frontend validates its own fields and formats its own responses; what happens to a request
between submit and its last output is written once, here: the default `max_tokens` (fill the
context up to the server's default), the metrics of every output (TTFT, inter-token gaps, token
counts, the outcome), and the abort that frees the request's slot and pages as soon as its
consumer stops reading (a cancelled RPC, a disconnected HTTP client, a stream closed early).
"""

from __future__ import annotations

from typing import AsyncIterator

from jaxserve.engine.client import EngineClient, RequestStream
from jaxserve.engine.request import RequestOutput
from jaxserve.serving.metrics import Metrics, RequestMetrics


class RequestLife:
    """A submitted request's stream, tracked: iterate `outputs()` (in `contextlib.aclosing`, so
    an early stop runs its cleanup at once); `timer` holds its metrics (token counts so far)."""

    def __init__(self, engine: EngineClient, metrics: Metrics, stream: RequestStream):
        self.engine, self.stream = engine, stream
        self.timer: RequestMetrics = metrics.request(len(stream.prompt_token_ids))

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """The engine's outputs; the outcome is recorded when the last of the request's n
        completions ends, "error" when the engine fails, "cancelled" (and the request aborted)
        when the consumer stops before either."""
        done = False
        try:
            async for out in self.stream:
                self.timer.tokens(len(out.token_ids))
                if out.finished and self.stream.finished:  # the last of the request's n completions
                    done = True
                    self.timer.finish(out.finish_reason)
                yield out
        except Exception:
            done = True
            self.timer.finish("error")
            raise
        finally:
            if not done:  # the client went away: free the slot and pages now
                self.timer.finish("cancelled")
                self.engine.abort(self.stream.request_id)
