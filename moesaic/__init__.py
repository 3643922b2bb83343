"""moesaic: an inference engine for hybrid and mixture-of-experts frontier models."""

from .engine.sampler import SamplingParams
from .errors import CapacityError, CheckpointError, ConfigError, MoesaicError, RequestError
from .llm import LLM, AsyncLLM, CompletionOutput, RequestOutput

__all__ = [
    "LLM",
    "AsyncLLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "MoesaicError",
    "ConfigError",
    "CheckpointError",
    "CapacityError",
    "RequestError",
]
__version__ = "0.1.0"
