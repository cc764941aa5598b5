"""A jaxserve Server in the test process, on its own event loop in a background thread, over any
engine the Server takes (an LLM, an EngineCore, a FakeEngine). No jax here: the fast tier's
frontend tests import it."""

from __future__ import annotations

import asyncio
import threading

from jaxserve.serving.server import Server


class ServerThread:
    """A jaxserve Server (gRPC unless port=None, HTTP when http_port is given) on its own loop."""

    def __init__(self, engine, port: int | None = 0, **kw):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = Server(engine, port=port, **kw)
        self.port = asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(60)
        self.target = f"127.0.0.1:{self.port}"
        self.base_url = f"http://127.0.0.1:{self.server.http_port}" if self.server.http_port is not None else None

    def run(self, coro, timeout: float = 60):
        """Run a coroutine on the server's loop (drain, say) and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self):
        self.run(self.server.stop(0), 30)
        self.loop.call_soon_threadsafe(self.loop.stop)


def stream_chats(base_url: str, api_key: str, model: str, conversations, **create) -> list[tuple[str, int]]:
    """Every conversation streamed at once through the real `openai` client (usage included):
    each one's text and its completion token count."""
    import openai

    async def one(c, conv):
        text, n = "", None
        stream = await c.chat.completions.create(
            model=model, messages=conv, stream=True, stream_options={"include_usage": True}, **create
        )
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            else:
                n = chunk.usage.completion_tokens
        return text, n

    async def main():
        c = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0)
        try:
            return await asyncio.gather(*(one(c, conv) for conv in conversations))
        finally:
            await c.close()

    return asyncio.run(main())
