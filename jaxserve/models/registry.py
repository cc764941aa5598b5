"""Which module implements which checkpoint architecture, and where the shipped models are.

Plain Python (no jax): the gin layer and the CLI resolve paths and validate architectures
without importing a model. The loader asks `model_class` for the module to build.
"""

from __future__ import annotations

import importlib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO_ROOT / "assets" / "models" / "default" / "target"
DEFAULT_DRAFT = REPO_ROOT / "assets" / "models" / "default" / "draft"

# transformers architecture name -> "module:class". Llama, Mistral and Qwen2 share one
# decoder; the config's flags (biases, tied embeddings, RoPE) say where they differ.
ARCHITECTURES = {
    "LlamaForCausalLM": "jaxserve.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "jaxserve.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "jaxserve.models.llama:LlamaForCausalLM",
}


def model_class(architecture: str) -> type:
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"model: architecture {architecture!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    module, name = ARCHITECTURES[architecture].split(":")
    return getattr(importlib.import_module(module), name)
