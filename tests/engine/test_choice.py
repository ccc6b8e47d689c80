"""The engine choice: the rule, the verdict kept per model file and conditions, and an explicit setting winning."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from tests.support.caches import Caches
from tests.support.engines import llama_cpp_or_skip
from ttft_sse.engine import choice
from ttft_sse.engine.base import StoresPrefixes
from ttft_sse.engine.batched.engine import BatchedEngine
from ttft_sse.engine.choice import AutoEngine, Choice, create_engine, decide
from ttft_sse.engine.fake import FakeEngine
from ttft_sse.engine.kernels import compiler
from ttft_sse.engine.llamacpp.engine import LlamaCppEngine
from ttft_sse.engine.loading import sources
from ttft_sse.engine.single import SingleEngine
from ttft_sse.settings import Settings

BUNDLED = sources.bundled_gguf()
"""The model the tests choose an engine for (the default): its metadata copied into each test's cache directory."""


def test_the_engine_faster_at_both_wins() -> None:
    verdict = decide({"batched": {"c1": 50.0, "c8": 200.0}, "llamacpp": {"c1": 60.0, "c8": 210.0}})
    assert (verdict.name, verdict.chosen_by, verdict.reason) == ("llamacpp", "measured", "faster at c=1 and at c=8")


def test_a_split_verdict_goes_to_the_larger_product_of_the_two_rates() -> None:
    # llama.cpp faster alone, the batched engine faster together, by more than it is slower alone.
    verdict = decide({"batched": {"c1": 50.0, "c8": 200.0}, "llamacpp": {"c1": 60.0, "c8": 100.0}})
    assert verdict.name == "batched"
    verdict = decide({"batched": {"c1": 30.0, "c8": 200.0}, "llamacpp": {"c1": 80.0, "c8": 100.0}})
    assert verdict.name == "llamacpp"


def test_an_explicit_engine_setting_always_wins(tmp_path: Path) -> None:
    assert isinstance(create_engine(Settings(engine="llamacpp")), LlamaCppEngine)
    assert isinstance(create_engine(Settings(engine="batched")), BatchedEngine)
    assert isinstance(create_engine(Settings(engine="single")), SingleEngine)
    assert isinstance(create_engine(Settings(engine="auto")), AutoEngine)
    assert choice.report(FakeEngine()) == {"name": "fake", "chosen_by": "setting"}


def test_auto_needs_no_measurement_for_a_model_llama_cpp_cannot_serve(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")

    def measure(settings: Settings, name: str) -> choice.Rates:
        raise AssertionError("nothing to measure")

    made = choice.choose(Settings(engine="auto", model=str(tmp_path)), measure=measure)
    assert (made.name, made.chosen_by) == ("batched", "only candidate")
    assert "GGUF" in made.reason


def test_a_verdict_is_kept_per_set_of_conditions_and_read_back(tmp_path: Path, fresh_cache: Caches) -> None:
    llama_cpp_or_skip()
    calls: list[tuple[str, int]] = []

    def measure(settings: Settings, name: str) -> choice.Rates:
        calls.append((name, settings.max_concurrency))
        return {"c1": 10.0, "c8": 20.0} if name == "batched" else {"c1": 5.0, "c8": 30.0}

    base = Settings(engine="auto", cache_dir=fresh_cache(tmp_path, BUNDLED))
    first = choice.choose(base, measure=measure)
    assert (first.name, first.chosen_by) == ("batched", "measured")  # 10 x 20 against 5 x 30
    assert choice.choose(base, measure=measure) == Choice(
        "batched", "measured before", first.reason, first.tokens_per_second
    )
    assert len(calls) == 2
    other = base.replace(max_concurrency=4, max_queue=4)
    assert choice.choose(other, measure=measure).chosen_by == "measured"  # other conditions: measured for them
    assert calls[2:] == [("batched", 4), ("llamacpp", 4)]
    assert choice.verdict_path(base) != choice.verdict_path(other)
    assert choice.verdict_path(base).parent == choice.verdict_path(other).parent  # beside the converted model


def test_another_build_of_the_block_kernel_measures_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_cache: Caches
) -> None:
    """A verdict holds for the kernel it was measured with: an upgrade that changes the kernel (here its flags) gives
    another key, and the engines are measured again."""
    llama_cpp_or_skip()
    calls: list[str] = []

    def measure(settings: Settings, name: str) -> choice.Rates:
        calls.append(name)
        return {"c1": 10.0, "c8": 20.0} if name == "batched" else {"c1": 5.0, "c8": 30.0}

    base = Settings(engine="auto", cache_dir=fresh_cache(tmp_path, BUNDLED))
    assert choice.choose(base, measure=measure).chosen_by == "measured"
    assert choice.choose(base, measure=measure).chosen_by == "measured before"
    monkeypatch.setattr(compiler, "FLAGS", (*compiler.FLAGS, "-DANOTHER_KERNEL"))
    assert choice.choose(base, measure=measure).chosen_by == "measured"
    assert calls == ["batched", "llamacpp", "batched", "llamacpp"]


def test_a_verdict_that_cannot_be_kept_is_logged_and_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_cache: Caches
) -> None:
    llama_cpp_or_skip()

    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise PermissionError("read-only file system")

    monkeypatch.setattr(Path, "replace", refuse)
    settings = Settings(engine="auto", cache_dir=fresh_cache(tmp_path, BUNDLED))
    with capture_logs() as logs:
        verdict = choice.choose(settings, measure=lambda _settings, name: {"c1": 1.0 + (name == "llamacpp"), "c8": 9.0})
    assert (verdict.name, verdict.chosen_by) == ("llamacpp", "measured")
    # the memory plan's tensor table could not be kept either (engine/kernels/stored.py): both logged, both used
    assert [log["event"] for log in logs] == ["gguf_header_not_kept", "engine_choice_not_written"]
    assert logs[1]["path"] == str(choice.verdict_path(settings)) and "read-only" in logs[1]["reason"]
    folder = choice.verdict_path(settings).parent  # the model's folder: its metadata, no verdict, no partial file
    assert not list(folder.glob(f"*{choice.VERDICT_STEM}*")) and not list(folder.glob(".*partial*"))


def test_auto_engine_is_the_chosen_engine_once_loaded() -> None:
    engine = AutoEngine(Settings(engine="auto"))
    with pytest.raises(RuntimeError, match="before load"):
        _ = engine.info
    assert engine.active == 0
    assert not hasattr(engine, "stats")  # read through to the chosen engine, once there is one


class _Storing:
    def __init__(self) -> None:
        self.calls: list[str] = []

    async def store_prefixes(self) -> None:
        self.calls.append("store")

    async def restore_prefixes(self) -> None:
        self.calls.append("restore")


def test_auto_engine_stores_and_restores_prefixes_where_the_chosen_engine_does() -> None:
    engine = AutoEngine(Settings(engine="auto"))
    assert isinstance(engine, StoresPrefixes)  # the runtime asks this before it calls them
    chosen = _Storing()
    engine._engine = chosen  # type: ignore[assignment]
    asyncio.run(engine.restore_prefixes())
    asyncio.run(engine.store_prefixes())
    assert chosen.calls == ["restore", "store"]
    engine._engine = object()  # type: ignore[assignment]  # an engine that keeps no prefixes (the single one)
    asyncio.run(engine.store_prefixes())  # nothing to do, nothing raised


def test_auto_takes_the_engine_whose_kv_cache_fits_where_only_one_does(tmp_path: Path, fresh_cache: Caches) -> None:
    """The bundled model in 1,550 MiB: beside its weights and working memory the batched engine's fp32 KV cache
    (``TTFT_KV_DTYPE=fp32``; 8,192 tokens: 377 MB) does not fit whole, llama.cpp's f16 one (189 MB) does; nothing is
    measured. With ``auto`` the batched engine's cache goes f16 where fp32 does not fit: both fit, and are measured."""
    llama_cpp_or_skip()

    def measure(settings: Settings, name: str) -> choice.Rates:
        raise AssertionError("nothing to measure")

    settings = Settings(engine="auto", cache_dir=fresh_cache(tmp_path, BUNDLED), memory_limit_mb=1550, kv_dtype="fp32")
    made = choice.choose(settings, measure=measure)
    assert (made.name, made.chosen_by) == ("llamacpp", "memory")
    assert made.reason.startswith("memory: batched would hold ") and "of its 8192 KV tokens in 1.5 GiB" in made.reason
    roomy = choice.choose(settings.replace(memory_limit_mb=4096), measure=lambda s, n: {"c1": 1.0, "c8": 1.0})
    assert roomy.chosen_by == "measured"  # both fit: measured as before
    narrow = choice.choose(settings.replace(kv_dtype="auto"), measure=measure)
    assert narrow.chosen_by == "measured before"  # both fit: the verdict just measured
