"""jaxserve: a JAX/XLA inference server for large language models."""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy so that `import jaxserve.kv_math` or the scheduler never pays for importing jax.
    if name in ("LLM", "SamplingParams", "RequestOutput"):
        from jaxserve import llm

        return getattr(llm, name)
    raise AttributeError(name)
