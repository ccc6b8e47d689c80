"""Files the engines keep in the cache directory (converted codes, laid-out arrays, the engine choice's verdict):
written whole or not at all, and never required.

Each is written to a partial file beside it, which then replaces it, so a reader never sees half a file (another
process starting on the same cache reads the old one or the new one). A cache directory that cannot be written is
not an error: the file's work is done again at the next start, and the log says why.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

import structlog

log = structlog.get_logger("ttft_sse.engine")


def write_whole(path: Path, write: Callable[[Path], None], event: str) -> bool:
    """``write`` fills a partial file (named like ``path``, its suffix kept) that then replaces ``path``; False, with a
    warning ``event`` naming the path and the reason, where the directory cannot be written."""
    partial = path.with_name(f".{path.stem}.{os.getpid()}.partial{path.suffix}")
    try:
        write(partial)
        partial.replace(path)
    except OSError as exc:
        log.warning(event, path=str(path), reason=repr(exc))
        with contextlib.suppress(OSError):  # where the directory is not one, the partial cannot even be looked for
            partial.unlink(missing_ok=True)
        return False
    return True
