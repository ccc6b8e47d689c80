"""Cache directories of a test's own (``TTFT_CACHE_DIR``), for the tests whose models' folders must be written anew,
sharing with the suite what is slow to make and not what those tests check: the C libraries (``kernels/`` links to
the suite's, where they are built already; the block kernel takes ~40 s of a core to compile) and each GGUF's
metadata (its config and tokenizer, engine/loading/sources.py: ~10 s for the bundled model's), written once a
session and copied in."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.support import builds
from ttft_sse.engine.loading import sources
from ttft_sse.engine.loading.model import KERNEL_DIR


class Caches:
    """Makes the cache directories; ``store`` keeps the metadata written for them (a session's temporary folder)."""

    def __init__(self, store: Path) -> None:
        self._store = store

    def __call__(self, directory: Path, *ggufs: Path) -> Path:
        """``directory`` made a cache directory whose C libraries are the suite's, holding each of ``ggufs``'
        metadata (nothing else of their folders: what the engines keep there is written anew). Returns it."""
        directory.mkdir(parents=True, exist_ok=True)
        builds.DIRECTORY.mkdir(parents=True, exist_ok=True)
        (directory / KERNEL_DIR).symlink_to(builds.DIRECTORY)
        for gguf in ggufs:
            written = sources.model_dir(gguf, self._store)
            if not written.is_dir():
                sources.write_metadata(gguf, written)
            shutil.copytree(written, sources.model_dir(gguf, directory))
        return directory
