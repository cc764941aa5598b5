"""A random Gemma 3 text model for benchmarking sliding-window KV (docs/benchmarks.md): 12 layers
in the 5 local : 1 global pattern (10 local, window 64), 2 KV heads of 64, a 4,096-token
vocabulary and 4,096 positions, saved with save_pretrained to the directory given.

    python -m jaxserve.tools.bench.gemma_model GEMMA_DIR
"""

from __future__ import annotations

import sys


def main(path: str) -> None:
    import torch
    import transformers as tf

    cfg = tf.Gemma3TextConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=12,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        sliding_window=64,
        query_pre_attn_scalar=64,
        eos_token_id=1,
        bos_token_id=0,
        pad_token_id=0,
    )
    cfg.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(0)
    tf.Gemma3ForCausalLM(cfg).eval().save_pretrained(path)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
