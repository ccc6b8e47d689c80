from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support import tinymodels
from tests.support.caches import Caches
from tests.support.paths import CACHE_DIR
from ttft_sse.engine.single import SingleEngine
from ttft_sse.settings import Settings
from ttft_sse.stages import StageClock


@pytest.fixture(scope="session")
def settings() -> Settings:
    # No prefill process (a second copy of the model, engine/first/process.py) unless a test asks for one: the suite's
    # engines and servers would each start one.
    return Settings(cache_dir=CACHE_DIR, threads=1, log_format="console", prefill_process=False)


@pytest.fixture(scope="module")
def reference(settings: Settings) -> SingleEngine:
    """The single-request engine, loaded: the texts and tokens the other engines are checked against."""
    engine = SingleEngine(settings)
    engine.load(StageClock())
    return engine


@pytest.fixture(scope="session")
def hf_app(settings: Settings) -> Iterator[object]:
    from ttft_sse.app import create_app

    yield create_app(settings)


@pytest.fixture(scope="session")
def hf_server(hf_app: object) -> Iterator[str]:
    """A real hypercorn server with the real bundled model, shared by the integration tests."""
    from tests.support.servers import running

    with running(hf_app) as base:  # type: ignore[arg-type]
        yield base


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tiny_models(family)``: the directory of that family's tiny random-weight model (tests/support/tinymodels.py),
    built on first use and kept for the rest of the session."""
    root = tmp_path_factory.mktemp("tiny-models")
    return lambda family: tinymodels.build(family, root)


@pytest.fixture(scope="session")
def fresh_cache(tmp_path_factory: pytest.TempPathFactory) -> Caches:
    """``fresh_cache(directory, *ggufs)``: ``directory`` made a cache directory of the test's own, whose C libraries
    are the suite's and which holds each GGUF's metadata, written once a session (tests/support/caches.py)."""
    return Caches(tmp_path_factory.mktemp("gguf-metadata"))
