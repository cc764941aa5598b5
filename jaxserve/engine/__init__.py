"""The engine: requests in, token deltas out, with no arrays in sight.

`loading.load_engine` loads a model and builds the parts; `core.EngineCore` steps the scheduler,
the KV manager and the model runner and detokenizes (`rows`: a plan's rows for the runner;
`speculation`: the host side of speculative decoding); `client.EngineClient` runs that loop in a
thread for the server frontends. `contract.Engine` names what the frontends call on a core;
`fake_engine.FakeEngine` keeps it over a fake model (no jax), for the frontends' tests; both
take requests in and deltas out through `intake.Intake`. The
scheduler, KV manager, page allocator, radix tree, request types and tokenizer glue are plain
Python, testable without jax. Above: the frontends (`jaxserve.serving`, `jaxserve.llm`). Below: the
runner, which it hands token ids and page ids.
"""
