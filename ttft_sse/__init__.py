"""ttft-sse: an LLM streaming server built for time-to-first-token."""

from __future__ import annotations

__version__ = "0.1.0"
