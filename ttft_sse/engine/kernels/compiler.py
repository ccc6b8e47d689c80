"""The C libraries the CPU engine calls (the block kernel's, attention's, the greedy pick's): built at the first start
by the system's C compiler for this CPU into the cache directory, named by a hash of their sources, the headers, the
flags, the compiler and the CPU's flags, and loaded with ctypes, which lets go of the GIL during a call. A compile can
be started ahead (:func:`start`), so that it runs on another core while the load converts and reads the model; the
:func:`build` that needs the library then waits for it. One compile a library at a time in a process."""

from __future__ import annotations

import atexit
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger("ttft_sse.engine")

KERNEL_DIR = "kernels"
"""Where in the cache directory the C libraries are built."""
HEADERS = tuple(
    Path(__file__).with_name(name)
    for name in ("kernel.h", "blocks.h", "vectors.h", "five.h", "six.h", "dense.h", "half.h")
)
"""kernel.h, which the kernel's files, decoder.c and attention.c include, blocks.h, which the kernel's files share,
kernel.c's own (vectors.h its vectors, five.h the Q5 types' 5-bit codes, six.h Q6_K's short panels, dense.h the dense
layers), and half.h (fp16 in plain C: vectors.h, attention.c and decoder.c): part of every library's hash."""
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-std=c11", "-shared", "-fPIC")
BUILD_SECONDS = 120


def c_compiler() -> str:
    """The C compiler the kernels are built with: ``cc``, else ``gcc``. Raises ``RuntimeError`` if neither is on
    PATH."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    return compiler


@dataclass
class _Compile:
    """One compiler process writing ``partial``, its messages going to ``messages`` (a file: a pipe nobody reads
    yet could fill and stop it)."""

    process: subprocess.Popen[bytes]
    partial: Path
    messages: Path
    deadline: float


_compiling: dict[Path, _Compile] = {}
_lock = threading.Lock()


def start(directory: Path, sources: tuple[Path, ...], name: str) -> None:
    """Start compiling the library :func:`build` gives for these arguments, in the background, unless it is built
    or being built already: the load then goes on (converting the model, reading it) on the other core, and the
    :func:`build` that needs the library waits for this compile instead of starting its own. Nothing where there is no
    compiler or the directory cannot be made: :func:`build` then says why."""
    try:
        compiler = c_compiler()
        target = directory / f"{name}-{key(sources, compiler)}.so"
        with _lock:
            if not target.is_file() and target not in _compiling:
                _compiling[target] = _spawn(compiler, sources, target)
    except (OSError, RuntimeError):
        return


def build(directory: Path, sources: tuple[Path, ...], name: str) -> Path:
    """The C files ``sources`` (the block kernel's library, engine/kernels/attention.c, argmax.c) compiled for this CPU
    into one library in ``directory``, ``name-<hash>.so``, compiled now (or the compile :func:`start` began waited
    for) if it is not there yet. Raises ``OSError`` (``RuntimeError`` for a failed compile) with the reason."""
    compiler = c_compiler()
    target = directory / f"{name}-{key(sources, compiler)}.so"
    with _lock:
        job = _compiling.get(target)
        if job is None:
            if target.is_file():
                return target
            job = _compiling[target] = _spawn(compiler, sources, target)
    try:
        job.process.wait(timeout=max(0.0, job.deadline - time.monotonic()))
    except subprocess.TimeoutExpired as exc:
        job.process.kill()
        job.process.wait()
        raise RuntimeError(f"{Path(compiler).name} took more than {BUILD_SECONDS} s") from exc
    finally:
        messages = _settle(target, job)
    if target.is_file():
        return target
    lines = [line for line in messages.splitlines() if "error" in line] or messages.splitlines()
    raise RuntimeError(f"{Path(compiler).name} failed: {lines[0] if lines else job.process.returncode}")


def _settle(target: Path, job: _Compile) -> str:
    """After ``job`` ended: the first of its waiters puts the library in place (or reads why it failed) and removes its
    files. Returns the compiler's messages (empty for the other waiters)."""
    with _lock:
        if _compiling.get(target) is not job or job.process.returncode is None:
            return ""
        del _compiling[target]
        messages = ""
        try:
            if job.process.returncode == 0:
                job.partial.replace(target)
                log.info("kernel_built", path=str(target))
            else:
                messages = _messages(job)
        finally:
            _remove(job)
        return messages


def _spawn(compiler: str, sources: tuple[Path, ...], target: Path) -> _Compile:
    target.parent.mkdir(parents=True, exist_ok=True)
    stem = target.parent / f".{target.name}.{os.getpid()}"
    partial, messages = stem.with_name(stem.name + ".partial"), stem.with_name(stem.name + ".log")
    try:
        with messages.open("wb") as log_file:
            process = subprocess.Popen(
                [compiler, *FLAGS, "-o", str(partial), *map(str, sources)],
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
            )
    except OSError:
        messages.unlink(missing_ok=True)
        raise
    _abandon_at_exit()
    return _Compile(process, partial, messages, time.monotonic() + BUILD_SECONDS)


def _messages(job: _Compile) -> str:
    try:
        return job.messages.read_text(errors="replace")
    except OSError:
        return ""


def _remove(job: _Compile) -> None:
    job.partial.unlink(missing_ok=True)
    job.messages.unlink(missing_ok=True)


@functools.cache
def _abandon_at_exit() -> None:
    atexit.register(_abandon)


def _abandon() -> None:
    """At exit: the compiles no build waited for are stopped and their files removed (a start that failed before
    it needed them)."""
    with _lock:
        left = list(_compiling.values())
        _compiling.clear()
    for job in left:
        job.process.kill()
        job.process.wait()
        _remove(job)


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
