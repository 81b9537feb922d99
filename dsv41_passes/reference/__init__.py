"""Plain-PyTorch DeepSeek-V4.1 reference: config, model, checkpoint loader.

This package imports nothing else of ``dsv41_passes``.
"""

from .config import DeepseekV41Config
from .loader import CheckpointError, load_checkpoint
from .model import DeepseekV41ForCausalLM

__all__ = ["CheckpointError", "DeepseekV41Config", "DeepseekV41ForCausalLM", "load_checkpoint"]
