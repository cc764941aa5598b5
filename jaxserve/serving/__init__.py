"""The server frontends: gRPC (`grpc_server`, with its Python `client`), Prometheus
`metrics`. Frontends know requests, not arrays: they talk to the engine only through
`jaxserve.engine.client.EngineClient`."""
