"""The C libraries built for this CPU and loaded (engine/kernels/compiler.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from ttft_sse.engine.kernels import attention, compiler, kernel


def test_a_source_that_does_not_compile_is_reported_with_the_compilers_error(tmp_path: Path) -> None:
    source = tmp_path / "kernel.c"
    source.write_text('#error "no such CPU"\n')
    with pytest.raises(RuntimeError, match=r"failed: .*error: #error \"no such CPU\""):
        compiler.build(tmp_path / "kernels", (source,), "blocks")
    assert list((tmp_path / "kernels").iterdir()) == []  # no partial file left


def test_a_library_is_built_once_for_its_sources_and_cpu_then_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A small source of its own: the kernel's sources take ~40 s of a core to compile, the same steps otherwise.
    source = tmp_path / "answer.c"
    source.write_text("int ttft_answer(void) { return 42; }\n")
    directory = tmp_path / "kernels"
    with capture_logs() as logs:
        built = compiler.build(directory, (source,), "blocks")
    assert built.parent == directory and built.name.startswith("blocks-") and built.suffix == ".so"
    assert [entry["event"] for entry in logs] == ["kernel_built"]
    assert compiler.load(built, "ttft_answer", ())() == 42

    def compile_again(*_args: Any, **_kwargs: Any) -> subprocess.Popen[bytes]:
        raise AssertionError("compiled again")

    monkeypatch.setattr(compiler.subprocess, "Popen", compile_again)
    assert compiler.build(directory, (source,), "blocks") == built
    monkeypatch.setattr(compiler, "cpu_features", lambda: b"flags : another cpu")
    with pytest.raises(AssertionError, match="compiled again"):  # another CPU gets its own build
        compiler.build(directory, (source,), "blocks")


def counted_compiles(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The compiler command lines started from now on (each still runs)."""
    started: list[list[str]] = []
    popen = subprocess.Popen

    def counted(command: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        started.append(command)
        return popen(command, **kwargs)

    monkeypatch.setattr(compiler.subprocess, "Popen", counted)
    return started


def test_a_compile_started_ahead_is_the_one_build_waits_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started = counted_compiles(monkeypatch)
    directory = tmp_path / "kernels"
    attention.start(directory)
    attention.start(directory)  # being built: not started again
    assert len(started) == 1 and not any(directory.glob("attention-*.so"))  # still compiling: no library yet
    with capture_logs() as logs:
        built = attention.build(directory)
    assert len(started) == 1 and [path.name for path in directory.iterdir()] == [built.name]  # its files cleared
    assert [entry["event"] for entry in logs] == ["kernel_built"]
    assert attention.function(built) is not None  # a whole library
    attention.start(directory)  # built: nothing to start
    assert attention.build(directory) == built and len(started) == 1


def test_a_compile_started_ahead_that_fails_is_reported_by_build_with_its_error(tmp_path: Path) -> None:
    source = tmp_path / "kernel.c"
    source.write_text('#error "no such CPU"\n')
    directory = tmp_path / "kernels"
    compiler.start(directory, (source,), "blocks")
    with pytest.raises(RuntimeError, match=r"failed: .*error: #error \"no such CPU\""):
        compiler.build(directory, (source,), "blocks")
    assert list(directory.iterdir()) == []  # neither the partial library nor the compiler's messages left


def test_a_compile_no_build_waited_for_is_stopped_and_cleared_at_exit(tmp_path: Path) -> None:
    directory = tmp_path / "kernels"
    kernel.start(directory)
    (job,) = [job for target, job in compiler._compiling.items() if target.parent == directory]
    compiler._abandon()
    assert job.process.returncode is not None and list(directory.iterdir()) == []
    assert not compiler._compiling


def test_nothing_is_started_without_a_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiler.shutil, "which", lambda name: None)
    kernel.start(tmp_path / "kernels")
    assert not (tmp_path / "kernels").exists()
    with pytest.raises(RuntimeError, match="no C compiler"):  # the build says why
        kernel.build(tmp_path / "kernels")
