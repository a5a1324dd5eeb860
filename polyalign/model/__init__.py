"""The decoder (the Llama, Qwen2, Qwen3, Gemma 2 and Gemma 3 families: architecture.FAMILIES) and Hugging Face
checkpoints in and out."""

from polyalign.model.architecture import ModelConfig, ModelConfigError, RopeScaling, family_defaults
from polyalign.model.hf import CheckpointError, checkpoint_tokenizer, load_hf_checkpoint, save_hf_checkpoint
from polyalign.model.transformer import Transformer, abstract_model, create_model

__all__ = ["CheckpointError", "ModelConfig", "ModelConfigError", "RopeScaling", "Transformer", "abstract_model",
           "checkpoint_tokenizer", "create_model", "family_defaults", "load_hf_checkpoint", "save_hf_checkpoint"]
