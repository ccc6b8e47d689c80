"""Where the suite keeps what it builds once per machine."""

from __future__ import annotations

from pathlib import Path

from ttft_sse.settings import Settings

# The suite uses the same converted-model cache as `make serve` (the Makefile prepares it), so the ~25 s GGUF
# conversion happens once per machine, not per test run.
CACHE_DIR = Path(Settings.from_env().cache_dir)
