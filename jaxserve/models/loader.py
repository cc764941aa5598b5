"""Load a checkpoint (a Hugging Face directory, or a GGUF file) into the nnx decoder.

Conversion (rename, transpose [out,in] -> [in,out], cast; with quantization="int8" the
projections' int8 weights and scales) is cached with orbax so that the next load skips it. The cache is keyed by a fingerprint of the checkpoint files and checked
against per-tensor checksums after restore: a corrupt cache, or one written for other
weights, is rebuilt and never silently used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.models import gguf, linear, registry
from jaxserve.models import quantization as quant
from jaxserve.models.contract import CheckpointTensor, mirrored_name
from jaxserve.models.model_config import ModelConfig

log = logging.getLogger("jaxserve.loader")

_CACHE_FORMAT = 2  # 2: the meta file carries the ModelConfig

# A model directory holding config.json and this file ({"seed": int, "std": float}) and no weights:
# load_model makes the weights on the device from jax.random (random_init). A model of a real one's
# shape (Llama-3.1-8B's 16 GB in bfloat16) then needs no checkpoint written, read or cast on the host.
RANDOM_INIT = "jaxserve_random_init.json"


def default_dtype() -> jnp.dtype:
    """bfloat16 on accelerators; float32 on CPU, where XLA's bf16 matmuls are 7-20x slower."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def _hf_name(path: tuple) -> tuple[str, bool]:
    """nnx state path -> (transformers tensor name, needs transpose), for modules whose names
    mirror transformers' (export.py writes Llama checkpoints with it)."""
    t = mirrored_name(path)
    return t.names[0], t.transpose


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({path / f for f in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {str(path)!r}")
    for f in files:
        if not f.is_file():
            raise ValueError(f"model: shard {str(f)!r} named in model.safetensors.index.json is missing")
    return files


def fingerprint(path: Path, dtype, quantization: str | None = None, keep: tuple[str, ...] = ()) -> str:
    """Cheap identity of the weights: sizes, safetensors headers (names, shapes, offsets) and
    sampled data bytes of every shard, plus config.json, the target dtype and the quantization
    (with the modules kept in full precision)."""
    tag = f"{_CACHE_FORMAT}:{jnp.dtype(dtype).name}"
    if quantization is not None:
        tag += f":{quantization}:{','.join(sorted(keep))}"
    h = hashlib.sha256(tag.encode())
    if gguf.is_gguf(path):
        gguf.fingerprint_update(h, path)
        return h.hexdigest()
    h.update((path / "config.json").read_bytes())
    for f in _safetensors_files(path):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            h.update(fh.read(n))
            for off in (8 + n, (size + n) // 2, max(8 + n, size - (1 << 20))):
                fh.seek(off)
                h.update(fh.read(1 << 20))
    return h.hexdigest()


def _read_checkpoint(
    path: Path, cfg: ModelConfig, wanted: dict[str, tuple[tuple, bool]], dtype
) -> dict[str, np.ndarray]:
    if gguf.is_gguf(path):
        return gguf.read_tensors(path, cfg, wanted, dtype)
    from safetensors import safe_open

    out: dict[str, np.ndarray] = {}
    files = _safetensors_files(path)
    t0 = time.time()
    for i, f in enumerate(files):
        with safe_open(str(f), framework="numpy") as st:
            for name in st.keys():
                if name not in wanted:
                    continue
                shape, transpose = wanted[name]
                arr = st.get_tensor(name)
                if transpose:
                    arr = arr.T
                if tuple(arr.shape) != tuple(shape):
                    raise ValueError(
                        f"{f.name}: tensor {name!r} has shape {tuple(arr.shape if not transpose else arr.T.shape)}, "
                        f"expected {tuple(shape if not transpose else shape[::-1])}"
                    )
                out[name] = np.ascontiguousarray(arr.astype(dtype))
        if len(files) > 1:
            log.info("loaded shard %d/%d (%s) in %.1fs", i + 1, len(files), f.name, time.time() - t0)
    missing = [n for n in wanted if n not in out]
    if missing:
        raise ValueError(
            f"model: tensor {missing[0]!r} is missing from the checkpoint in {str(path)!r}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    return out


def _checksums(arrays: dict[str, np.ndarray]) -> dict[str, float]:
    return {k: float(np.asarray(v, dtype=np.float64).sum()) for k, v in arrays.items()}


def default_cache_root() -> Path:
    return Path(os.environ.get("JAXSERVE_CACHE_DIR", Path.home() / ".cache" / "jaxserve")) / "converted"


def replace_dir(target: Path, write: Callable[[Path], None]) -> None:
    """Write a folder beside `target` (`write(tmp)`) and rename it into place, replacing what was
    there. A process reading `target` never sees half of it, and two processes writing the same
    target at once (two servers converting one checkpoint) never write into one folder: the later
    rename replaces the earlier copy, which holds the same content, and where the other process
    re-creates `target` between removal and rename, its copy is kept. No temporary folder outlives
    the call; OSError from creating the parent (a read-only cache) reaches the caller."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write(tmp)
        shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:  # another process put its copy there in between
            log.info("%s was written by another process; keeping that copy", target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _restore_cache(cache: Path, fp: str, names: list[str]) -> dict[str, np.ndarray] | None:
    meta_file = cache / "jaxserve_meta.json"
    if not meta_file.is_file():
        return None
    try:
        meta = json.loads(meta_file.read_text())
        if meta.get("fingerprint") != fp:
            log.warning("converted-weight cache %s belongs to other weights; rebuilding", cache)
            return None
        import orbax.checkpoint as ocp

        restored = ocp.StandardCheckpointer().restore((cache / "params").absolute())
        arrays = {meta["keys"][k]: np.asarray(v) for k, v in restored.items()}
        if sorted(arrays) != sorted(names) or _checksums(arrays) != meta["checksums"]:
            log.warning("converted-weight cache %s is corrupt (checksum mismatch); rebuilding", cache)
            return None
        return arrays
    except Exception as e:  # any unreadable cache is rebuilt, never used
        log.warning("converted-weight cache %s is unreadable (%s); rebuilding", cache, e)
        return None


def _cached_config(cache: Path, fp: str) -> ModelConfig | None:
    """The ModelConfig stored beside converted weights of the same fingerprint (which covers
    config.json): a restart then skips importing transformers' config machinery."""
    try:
        meta = json.loads((cache / "jaxserve_meta.json").read_text())
        if meta.get("fingerprint") != fp:
            return None
        return ModelConfig.from_json(meta["config"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _save_cache(cache: Path, fp: str, arrays: dict[str, np.ndarray], cfg: ModelConfig) -> None:
    import orbax.checkpoint as ocp

    def write(d: Path) -> None:
        keys = {f"t{i}": n for i, n in enumerate(arrays)}
        ckptr = ocp.StandardCheckpointer()
        ckptr.save((d / "params").absolute(), {k: arrays[n] for k, n in keys.items()})
        ckptr.wait_until_finished()
        (d / "jaxserve_meta.json").write_text(
            json.dumps({"fingerprint": fp, "keys": keys, "checksums": _checksums(arrays), "config": cfg.to_json()})
        )

    replace_dir(cache, write)  # a stale, corrupt or other fingerprint's copy (_restore_cache refused it) goes


def check_checkpoint(path: str | Path) -> None:
    """The errors a user can fix (missing file, unsupported architecture), before any weights are read."""
    if gguf.is_gguf(path):
        gguf.check_file(path)
    else:
        ModelConfig.check_dir(path)


def read_config(path: str | Path) -> ModelConfig:
    """The checkpoint's ModelConfig: from config.json (through transformers), or a GGUF's metadata."""
    return gguf.read_config(path) if gguf.is_gguf(path) else ModelConfig.from_dir(path)


def load_model(
    path: str | Path,
    dtype=None,
    cache_dir: str | Path | None = None,
    use_cache: bool = True,
    quantization: str | None = None,
    keep_full_precision: tuple[str, ...] = (),
) -> tuple[nnx.Module, ModelConfig]:
    """Load a checkpoint directory, or a GGUF file (models/gguf.py dequantizes it to float32,
    then it is cast or quantized like any checkpoint). cache_dir: where converted weights live (default
    $JAXSERVE_CACHE_DIR/converted/<fingerprint>); use_cache=False converts every time.

    quantization="int8": every projection (attention, MLP and an untied LM head) gets int8
    weights with per-output-channel scales, computed here from the checkpoint's float weights
    (widened to float32 first) and cached with the rest; ``keep_full_precision`` names
    projections to leave in ``dtype`` (e.g. ("lm_head",)). The token embedding, and with it a
    tied LM head, stays in ``dtype``: a lookup reads one row per token, so int8 would save memory
    but no step time."""
    path = Path(path)
    check_checkpoint(path)
    quant.check_mode(quantization)
    keep = tuple(keep_full_precision)
    dtype = jnp.dtype(dtype or default_dtype())
    if (path / RANDOM_INIT).is_file():
        return random_init(path, dtype, quantization)
    cfg = None
    if use_cache:
        fp = fingerprint(path, dtype, quantization, keep)
        cache = Path(cache_dir) if cache_dir else default_cache_root() / f"{path.name}-{fp[:16]}"
        cfg = _cached_config(cache, fp)  # parsed by transformers when the cache was written
    if cfg is None:
        cfg = read_config(path)
    family = registry.family(cfg.architecture)
    abstract = nnx.eval_shape(lambda: family.model(cfg, dtype=dtype))
    quantized = linear.quantize_modules(abstract, quantization, keep)
    graphdef, abs_state = nnx.split(abstract)
    flat = nnx.to_flat_state(abs_state)
    tensors = {p: family.checkpoint_tensor(p, cfg) for p, _ in flat}
    wanted, wanted_q = {}, {}  # read in dtype / read in float32 and quantized here
    qweights = {tuple(str(x) for x in q) + ("weight",) for q in quantized}
    for p, var in flat:
        if tuple(str(x) for x in p) in qweights:
            _want(wanted_q, tensors[p], tuple(var.shape))
        elif str(p[-1]) != "weight_scale" or tuple(str(x) for x in p[:-1]) + ("weight",) not in qweights:
            _want(wanted, tensors[p], tuple(var.shape))

    arrays = None
    names = [t.key for t in tensors.values()]
    if use_cache:
        arrays = _restore_cache(cache, fp, names)
        if arrays is not None:
            log.info("restored converted weights from %s", cache)
    if arrays is None:
        arrays = _read_checkpoint(path, cfg, wanted, dtype)
        if wanted_q:
            t0 = time.time()
            for name, w in _read_checkpoint(path, cfg, wanted_q, np.float32).items():
                q, scale = quant.quantize_int8(w)
                arrays[name] = np.asarray(q)
                arrays[name + "_scale"] = np.asarray(scale)
            log.info("quantized %d projections to int8 in %.1fs", len(wanted_q), time.time() - t0)
        for t in tensors.values():  # experts: one tensor per expert in the checkpoint, one stack here
            if t.stacked_as is not None:
                arrays[t.key] = np.stack([arrays.pop(n) for n in t.names])
        if use_cache:
            _save_cache(cache, fp, arrays, cfg)
    leaves = []
    for p, var in flat:
        leaves.append((p, var.replace(jnp.asarray(arrays[tensors[p].key]))))
    state = nnx.from_flat_state(leaves)
    return nnx.merge(graphdef, state), cfg


def write_random_init(out: Path, config: dict, seed: int = 0, std: float = 0.02) -> Path:
    """A model directory whose weights load_model makes on the device: `config` (a transformers
    config.json's fields) and the RANDOM_INIT marker with the seed and the weights' std."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / RANDOM_INIT).write_text(json.dumps({"seed": seed, "std": std}))
    return out


def random_init(path: Path, dtype, quantization: str | None = None) -> tuple[nnx.Module, ModelConfig]:
    """The model of `path`'s config.json with seeded random weights made where jax computes (the
    accelerator), in `dtype` from the start: the family's own initializers (normal(std)
    projections and embeddings, unit norms) under one jit, so no float32 copy and no host
    array ever exists. Weights only for benchmarks (`jaxserve bench device`): nothing is cached."""
    if quantization is not None:
        raise ValueError(f"model: {path} has random weights ({RANDOM_INIT}); quantization is not supported there")
    spec = json.loads((path / RANDOM_INIT).read_text())
    cfg = read_config(path)
    family = registry.family(cfg.architecture)
    seed, std = int(spec.get("seed", 0)), float(spec.get("std", 0.02))
    make = lambda: nnx.split(family.model(cfg, dtype=dtype, rngs=nnx.Rngs(seed), init_std=std))  # noqa: E731
    graphdef, _ = nnx.eval_shape(make)
    state = jax.jit(lambda: make()[1])()
    log.info("made random %s weights (seed %d, std %g, %s) on %s", cfg.architecture, seed, std, dtype.name,
             jax.devices()[0].device_kind)  # fmt: skip
    return nnx.merge(graphdef, state), cfg


def _want(wanted: dict[str, tuple[tuple, bool]], t: CheckpointTensor, shape: tuple) -> None:
    """Ask the checkpoint readers for the tensor(s) of a parameter of `shape` (a stack's own
    tensors are each its shape without the leading expert axis)."""
    for name in t.names:
        wanted[name] = (shape[1:] if t.stacked_as is not None else shape, t.transpose)
