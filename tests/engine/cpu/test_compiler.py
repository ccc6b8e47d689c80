"""The C libraries built for this CPU and loaded (engine/cpu/compiler.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from ttft_sse.engine.cpu import compiler, kernel


def test_a_source_that_does_not_compile_is_reported_with_the_compilers_error(tmp_path: Path) -> None:
    source = tmp_path / "kernel.c"
    source.write_text('#error "no such CPU"\n')
    with pytest.raises(RuntimeError, match=r"failed: .*error: #error \"no such CPU\""):
        compiler.build(tmp_path / "kernels", (source,), "blocks")
    assert list((tmp_path / "kernels").iterdir()) == []  # no partial file left


def test_a_library_is_built_once_for_its_sources_and_cpu_then_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "kernels"
    with capture_logs() as logs:
        built = kernel.build(directory)
    assert built.parent == directory and built.name.startswith("blocks-") and built.suffix == ".so"
    assert [entry["event"] for entry in logs] == ["kernel_built"]

    def compile_again(*_args: Any, **_kwargs: Any) -> subprocess.CompletedProcess[str]:
        raise AssertionError("compiled again")

    monkeypatch.setattr(compiler.subprocess, "run", compile_again)
    assert kernel.build(directory) == built
    monkeypatch.setattr(compiler, "cpu_features", lambda: b"flags : another cpu")
    with pytest.raises(AssertionError, match="compiled again"):  # another CPU gets its own build
        kernel.build(directory)
