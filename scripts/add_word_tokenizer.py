"""Give a random-weight checkpoint a word-level tokenizer, so that servers that need one (vLLM's,
jaxserve's HTTP API) load it and stream text: token i is the word "w<i>", words split on spaces,
<s> / </s> / <unk> as ids 0-2 (the bench prompts draw ids from 3 up).

    .venv/bin/python scripts/add_word_tokenizer.py /tmp/bench56-tok   # a copy of /tmp/jaxserve-bench-56m

Used by scripts/bench_serve_vllm.sh's serving runs (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast


def main(model_dir: str) -> None:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    n = cfg["vocab_size"]
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, n)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(model_dir)
    print(f"{model_dir}: word-level tokenizer, {n} tokens")


if __name__ == "__main__":
    main(sys.argv[1])
