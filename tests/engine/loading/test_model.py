"""Loading a model (engine/loading/model.py): the imports stage's collector, and what transformers is asked for."""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from ttft_sse.engine.loading import model
from ttft_sse.settings import Settings
from ttft_sse.stages import StageClock


@pytest.fixture
def collector() -> Iterator[None]:
    """The collector on and nothing frozen by the test left frozen afterwards."""
    was = gc.isenabled()
    yield
    gc.unfreeze()
    if was:
        gc.enable()


@pytest.mark.usefixtures("collector")
def test_the_first_imports_run_without_the_collector_and_what_they_made_is_frozen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delitem(sys.modules, "transformers.modeling_utils", raising=False)  # as in a new process
    gc.enable()
    gc.unfreeze()
    with model._imports_uncollected():
        assert not gc.isenabled()
        made = [[index] for index in range(1000)]  # lists, which the collector tracks
    assert gc.isenabled()
    assert gc.get_freeze_count() >= len(made)


@pytest.mark.usefixtures("collector")
def test_later_loads_and_a_collector_turned_off_are_left_as_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers.modeling_utils", sys)  # imported already
    gc.enable()
    gc.unfreeze()
    with model._imports_uncollected():
        assert gc.isenabled()
    assert gc.get_freeze_count() == 0

    monkeypatch.delitem(sys.modules, "transformers.modeling_utils")
    gc.disable()
    with model._imports_uncollected():
        pass
    assert not gc.isenabled() and gc.get_freeze_count() == 0


def test_a_model_is_loaded_without_the_hubs_kernels(tiny_models: Callable[[str], Path], settings: Settings) -> None:
    # transformers would otherwise swap layers for kernels it downloads from the Hugging Face Hub on CUDA (seen on an
    # offline H200: the start failed with "not available in the local cache"); on CPU it marks the model the same way.
    loaded = model.load_model(replace(settings, model=str(tiny_models("llama"))), StageClock())
    assert loaded.model.use_kernels is False
