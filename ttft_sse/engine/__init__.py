"""The engine seam: one interface (``base``), the transformers engine (``hf``), a scripted fake (``fake``)."""

from __future__ import annotations

from ttft_sse.engine.base import (
    ChatMessage,
    Engine,
    Finished,
    ModelInfo,
    Piece,
    Prompt,
    SamplingParams,
    Usage,
)

__all__ = ["ChatMessage", "Engine", "Finished", "ModelInfo", "Piece", "Prompt", "SamplingParams", "Usage"]
