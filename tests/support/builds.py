"""The C libraries the tests check as other CPUs get them (compiler flags that turn instruction sets off), built in
the suite's kernel directory beside this CPU's: a library's name hashes its flags (engine/kernels/compiler.py), so each
build is compiled once per machine (the block kernel's takes ~40 s of a core) and every module that checks it loads
the same file."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.support.paths import CACHE_DIR
from ttft_sse.engine.kernels import compiler
from ttft_sse.engine.loading.model import KERNEL_DIR

DIRECTORY = CACHE_DIR / KERNEL_DIR
"""Where the engine builds its libraries for this CPU, and the tests theirs for the others."""


@contextmanager
def flags(*extra: str) -> Iterator[None]:
    """The compiler's flags and ``extra`` (``-mno-avx512f``: what a CPU without AVX-512 gets) within the block: the
    builds started there, and the libraries looked up there by their key (``kernel.apply``), are that CPU's."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compiler, "FLAGS", (*compiler.FLAGS, *extra))
        yield


def built(build: Callable[[Path], Path], *extra: str) -> Path:
    """``build`` (``kernel.build``, ``attention.build``) with the compiler's flags and ``extra``, in :data:`DIRECTORY`
    (compiled there unless a run before built it)."""
    with flags(*extra):
        return build(DIRECTORY)


def copy_of(library: Path, directory: Path) -> Path:
    """``library`` copied into ``directory``: another file, which the dynamic loader loads apart from the first, with
    its own globals (the kernel's helper threads and their counts)."""
    directory.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy2(library, directory / library.name))
