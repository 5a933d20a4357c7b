"""cbrun's continuous-batching inference engine."""

from engine.config import ContinuousBatchingConfig, EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats

__all__ = ["ContinuousBatchingConfig", "EngineConfig", "EngineStats", "LLMEngine", "Request", "RequestOutput",
           "RequestStatus", "SamplingParams"]
