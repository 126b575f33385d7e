"""Idleless: an LLM serving engine that keeps the accelerator busy."""

from idleless.config import EngineConfig
from idleless.engine.request import FinishReason, RequestError, SamplingParams

__all__ = ["Engine", "EngineConfig", "SamplingParams", "FinishReason", "RequestError"]


def __getattr__(name):
    if name == "Engine":  # lazy: importing idleless must not import torch
        from idleless.engine.engine import Engine
        return Engine
    raise AttributeError(name)
