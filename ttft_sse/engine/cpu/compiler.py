"""The C libraries the CPU engine calls (the block kernel's, attention's, the greedy pick's): built at the first start
by the system's C compiler for this CPU into the cache directory, named by a hash of their sources, the headers, the
flags, the compiler and the CPU's flags, and loaded with ctypes, which lets go of the GIL during a call."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger("ttft_sse.engine")

HEADERS = tuple(
    Path(__file__).with_name(name) for name in ("kernel.h", "blocks.h", "vectors.h", "five.h", "six.h", "dense.h")
)
"""kernel.h, which the kernel's files, decoder.c and attention.c include, blocks.h, which the kernel's files share, and
kernel.c's own (vectors.h its vectors, five.h the Q5 types' 5-bit codes, six.h Q6_K's short panels, dense.h the dense
layers): part of every library's hash."""
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-std=c11", "-shared", "-fPIC")
BUILD_SECONDS = 120


def c_compiler() -> str:
    """The C compiler the kernels are built with: ``cc``, else ``gcc``. Raises ``RuntimeError`` if neither is on
    PATH."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    return compiler


def build(directory: Path, sources: tuple[Path, ...], name: str) -> Path:
    """The C files ``sources`` (the block kernel's library, engine/cpu/attention.c, argmax.c) compiled for this CPU
    into one library in ``directory``, ``name-<hash>.so``, compiled now if it is not there yet. Raises ``OSError``
    (``RuntimeError`` for a failed compile) with the reason."""
    compiler = c_compiler()
    target = directory / f"{name}-{key(sources, compiler)}.so"
    if target.is_file():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    partial = directory / f".{target.name}.{os.getpid()}.partial"
    try:
        done = subprocess.run(
            [compiler, *FLAGS, "-o", str(partial), *map(str, sources)],
            capture_output=True,
            text=True,
            timeout=BUILD_SECONDS,
        )
        if done.returncode != 0:
            lines = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines()
            raise RuntimeError(f"{Path(compiler).name} failed: {lines[0] if lines else done.returncode}")
        partial.replace(target)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"{Path(compiler).name} took more than {BUILD_SECONDS} s") from exc
    finally:
        partial.unlink(missing_ok=True)
    log.info("kernel_built", path=str(target))
    return target


def key(sources: tuple[Path, ...], compiler: str | None = None) -> str:
    """The hash that names the library of ``sources`` built for this CPU: their bytes and the headers', the flags, the
    compiler (default: :func:`c_compiler`'s) and the CPU's features. Another key, another build."""
    compiler = compiler or c_compiler()
    parts = [
        *(source.read_bytes() for source in (*sources, *HEADERS)),
        " ".join(FLAGS).encode(),
        os.path.realpath(compiler).encode(),
        cpu_features(),
    ]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def cpu_features() -> bytes:
    """The CPU's feature flags (a build for one CPU must not be loaded on another)."""
    try:
        with open("/proc/cpuinfo", "rb") as info:
            return next((line for line in info if line.startswith(b"flags")), b"")
    except OSError:
        return os.uname().machine.encode()


@functools.cache
def load(path: Path, name: str, arguments: tuple[Any, ...]) -> Any:
    """The function ``name`` of a library :func:`build` made (at ``path``), taking ``arguments`` (ctypes types) and
    returning an ``int`` status; loaded once."""
    fn = getattr(ctypes.CDLL(str(path)), name)
    fn.argtypes = list(arguments)
    fn.restype = ctypes.c_int
    return fn
