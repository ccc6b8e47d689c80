"""The greedy pick in C (engine/kernels/argmax.py, engine/kernels/argmax.c), against torch.argmax's rule."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from structlog.testing import capture_logs

from tests.support.paths import CACHE_DIR
from ttft_sse.engine.kernels import argmax
from ttft_sse.engine.kernels.compiler import KERNEL_DIR
from ttft_sse.engine.library.hooks import pick_greedy

torch = pytest.importorskip("torch")

NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def picker() -> argmax.Argmax:
    with capture_logs() as logs:
        built = argmax.build(CACHE_DIR / KERNEL_DIR)
    assert built is not None, logs
    assert [entry["event"] for entry in logs][-1] == "argmax_c"  # after kernel_built, at its first build
    return built


def rows_with_hazards(n: int) -> Any:
    """Rows of n floats: random ones, and the cases the rule decides: ties (in the vector part and in the tail),
    NaNs, -inf, signed zeros."""
    generator = torch.Generator().manual_seed(n)
    rows = [torch.randn(n, generator=generator) for _ in range(4)]
    tie = torch.randn(n, generator=generator)
    tie[n // 3] = tie[n - 1] = tie.max() + 1.0  # the first of the two
    rows += [tie, torch.full((n,), -INF), torch.zeros(n)]
    zeros = torch.full((n,), -1.0)
    zeros[n // 2] = -0.0
    zeros[n - 1] = 0.0
    rows.append(zeros)
    for at in {0, n // 2, n - 1}:  # a NaN wins wherever it is, the first of several
        nans = torch.randn(n, generator=generator)
        nans[at] = NAN
        nans[n - 1] = NAN
        rows.append(nans)
    finite = torch.full((n,), -INF)
    finite[n - 1] = 0.0  # a sampled row: only the drawn token left finite (engine/batched/engine.py's selection)
    rows.append(finite)
    return torch.stack(rows)


@pytest.mark.parametrize("n", [1, 7, 8, 15, 16, 17, 33, 49152, 49157])
def test_each_rows_argmax_is_torchs(picker: argmax.Argmax, n: int) -> None:
    scores = rows_with_hazards(n)
    want = torch.argmax(scores, dim=-1)
    assert picker.takes(scores, torch)
    assert picker.rows(scores, torch).tolist() == want.tolist()
    # Rows of a wider tensor (a stride larger than the row), as a slice of logits can be.
    wide = torch.full((scores.size(0), n + 5), 1e30)
    wide[:, :n] = scores
    view = wide[:, :n]
    assert picker.takes(view, torch) and not view.is_contiguous()
    assert picker.rows(view, torch).tolist() == want.tolist()


def test_it_takes_only_2d_fp32_cpu_rows_of_unit_stride(picker: argmax.Argmax) -> None:
    scores = torch.randn(3, 40)
    assert picker.takes(scores, torch)
    assert not picker.takes(scores.t(), torch)  # columns apart: not rows it reads
    assert not picker.takes(scores.double(), torch)
    assert not picker.takes(scores[None], torch)
    assert not picker.takes(torch.empty(3, 0), torch)
    assert picker.rows(torch.empty(0, 40), torch).tolist() == []


def runner(**options: Any) -> Any:
    """A stand-in for transformers' ModelRunner: its flags, and a ``_sample`` that records what reached it."""
    reached: list[Any] = []

    def library_sample(scores: Any, output_ids: Any) -> None:
        reached.append(scores)
        output_ids[0, : scores.size(1)] = -7

    flags = {"do_sample": False, "return_logprobs": False} | options
    return SimpleNamespace(_sample=library_sample, reached=reached, **flags)


def test_pick_greedy_writes_each_rows_argmax_where_the_library_would_take_torchs(picker: argmax.Argmax) -> None:
    model_runner = runner()
    pick_greedy(model_runner, picker, torch)
    scores = rows_with_hazards(49152)[None]  # [1, rows, vocabulary], as the library hands them over
    output_ids = torch.full((2, 20), -1, dtype=torch.int32)
    model_runner._sample(scores, output_ids)
    rows = scores.size(1)
    assert output_ids[0, :rows].tolist() == torch.argmax(scores[0], dim=-1).tolist()
    assert output_ids[0, rows:].tolist() == [-1] * (20 - rows) and output_ids[1].tolist() == [-1] * 20
    assert model_runner.reached == []
    sample = model_runner._sample
    pick_greedy(model_runner, picker, torch)  # a batch processor reset keeps its runner: once is enough
    assert model_runner._sample is sample


@pytest.mark.parametrize(
    ("options", "scores"),
    [
        ({"do_sample": True}, torch.randn(1, 2, 64)),
        ({"return_logprobs": True}, torch.randn(1, 2, 64)),
        ({}, torch.randn(1, 2, 64).double()),
        ({}, torch.randn(2, 2, 64)),
    ],
    ids=["sampling", "logprobs", "float64", "two-batches"],
)
def test_anything_else_goes_to_the_librarys_sample(picker: argmax.Argmax, options: dict[str, Any], scores: Any) -> None:
    model_runner = runner(**options)
    pick_greedy(model_runner, picker, torch)
    output_ids = torch.zeros((2, 4), dtype=torch.int32)
    model_runner._sample(scores, output_ids)
    assert model_runner.reached == [scores]
    assert output_ids[0, :2].tolist() == [-7, -7]


def test_without_a_compiler_the_log_says_torch_keeps_the_pick(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc, no gcc
    with capture_logs() as logs:
        assert argmax.build(tmp_path / "kernels") is None
    assert [(entry["event"], entry["reason"]) for entry in logs] == [
        ("argmax_torch", "no C compiler (cc or gcc) on PATH")
    ]


def test_prepare_builds_it_for_the_servers_first_start(settings: Any) -> None:
    from ttft_sse.__main__ import _prepare

    directory = settings.cache_dir / KERNEL_DIR
    for built in directory.glob("argmax-*.so"):
        built.unlink()  # the library a loaded one maps stays mapped
    with capture_logs() as logs:
        assert _prepare(settings) == 0
    assert "argmax_c" in [entry["event"] for entry in logs]
    assert len(list(directory.glob("argmax-*.so"))) == 1
