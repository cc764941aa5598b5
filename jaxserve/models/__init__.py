from jaxserve.models.config import ModelConfig
from jaxserve.models.llama import AttentionMetadata, LlamaForCausalLM

__all__ = ["ModelConfig", "LlamaForCausalLM", "AttentionMetadata"]
