"""Memory hygiene in the transformers engine, without CUDA: when the allocator cache is emptied, and from where."""

from __future__ import annotations

import threading
from contextlib import aclosing
from typing import Any

import pytest

from ttft_sse.engine.base import Finished, Piece, Prompt, SamplingParams, Usage
from ttft_sse.engine.loaded import CacheJanitor
from ttft_sse.engine.single import SingleEngine
from ttft_sse.engine.threads import Emit
from ttft_sse.errors import EngineError
from ttft_sse.settings import Settings, SettingsError


class Spy:
    def __init__(self) -> None:
        self.calls = 0
        self.threads: list[str] = []

    def __call__(self) -> None:
        self.calls += 1
        self.threads.append(threading.current_thread().name)


def test_the_cache_is_emptied_on_every_nth_generation() -> None:
    spy = Spy()
    janitor = CacheJanitor(3, spy)
    emptied = [janitor.generation_ended() for _ in range(7)]
    assert emptied == [False, False, True, False, False, True, False]
    assert (spy.calls, janitor.emptied, janitor.generations) == (2, 2, 7)


def test_every_zero_never_empties() -> None:
    spy = Spy()
    janitor = CacheJanitor(0, spy)
    assert not any(janitor.generation_ended() for _ in range(5000))
    assert spy.calls == 0


def test_a_negative_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="every must be 0"):
        CacheJanitor(-1, Spy())


def test_counting_from_many_worker_threads_loses_no_generation() -> None:
    spy = Spy()
    janitor = CacheJanitor(100, spy)
    start = threading.Barrier(8)

    def work() -> None:
        start.wait()
        for _ in range(250):
            janitor.generation_ended()

    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert (janitor.generations, spy.calls) == (2000, 20)


def test_the_setting_defaults_to_every_1000_generations() -> None:
    assert Settings().cuda_empty_cache_every == 1000
    assert Settings.from_env({"TTFT_CUDA_EMPTY_CACHE_EVERY": "0"}).cuda_empty_cache_every == 0
    with pytest.raises(SettingsError, match="cuda_empty_cache_every must be 0 or more, got -1"):
        Settings.from_env({"TTFT_CUDA_EMPTY_CACHE_EVERY": "-1"})


class ScriptedHF(SingleEngine):
    """The real SingleEngine.stream → worker thread → janitor path, with ``_generate`` scripted (no model)."""

    def __init__(self, *, fail: bool = False) -> None:
        super().__init__(Settings())
        self.fail = fail

    def _generate(self, prompt: Prompt, params: SamplingParams, emit: Emit[Any], cancelled: Any) -> None:
        emit(Piece(0, "hi"))
        if self.fail:
            raise RuntimeError("CUDA error: out of memory")
        emit(Finished("stop", Usage(prompt.n_tokens, 1), {"prefill_ms": 0.0, "decode_ms": 0.0}))


async def drain(engine: SingleEngine) -> list[Any]:
    async with aclosing(engine.stream(Prompt("x", (1, 2)), SamplingParams(max_tokens=4))) as items:
        return [item async for item in items]


async def test_the_janitor_runs_in_the_worker_thread_after_the_answer_and_counts_failed_generations() -> None:
    engine = ScriptedHF()
    spy = Spy()
    engine._loaded.janitor = CacheJanitor(2, spy)  # what load() installs on CUDA
    first = await drain(engine)
    assert isinstance(first[-1], Finished) and spy.calls == 0
    engine.fail = True
    with pytest.raises(EngineError, match="RuntimeError"):
        await drain(engine)
    assert spy.calls == 1  # the failed generation was the 2nd
    assert spy.threads[0].startswith("ttft-gen-")  # not the event loop's thread


def test_before_load_and_on_cpu_the_janitor_never_empties() -> None:
    engine = SingleEngine(Settings(cuda_empty_cache_every=1))
    assert engine.janitor.every == 0  # load() installs a real one only when the model sits on CUDA
