"""The server process (`server`: gRPC and HTTP frontends over one engine client, health, drain,
a loud death) and its frontends: gRPC (`grpc_server`, with its Python `client`), the
OpenAI-compatible HTTP API (`http_server`), Prometheus `metrics`. Frontends know requests, not
arrays: they talk to the engine only through `jaxserve.engine.client.EngineClient`."""
