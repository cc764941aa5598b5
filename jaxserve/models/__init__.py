"""Models: the Llama-family decoder (flax nnx), its linear layer, the architecture registry
and Hugging Face checkpoint loading and export. Below the runner, above the kernels: a model
is a pure function of (params, tokens, positions, KV pages, attention metadata)."""
