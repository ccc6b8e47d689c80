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


@pytest.mark.parametrize(
    ("device", "dtype", "gpu", "early"),
    [
        ("cpu", "auto", True, True),
        ("auto", "float32", False, True),
        ("auto", "auto", True, False),  # torch may see it: once the device is known
        ("cpu", "bfloat16", False, False),  # no C layers
        ("cuda", "auto", False, False),
    ],
)
def test_the_c_builds_start_before_the_imports_only_where_the_load_is_plainly_on_cpu_in_fp32(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, settings: Settings, device: str, dtype: str, gpu: bool, early: bool
) -> None:
    node = tmp_path / "nvidiactl"
    if gpu:
        node.write_text("")
    monkeypatch.setattr(model, "GPU_NODES", (str(node),))
    assert model._plainly_cpu_fp32(replace(settings, device=device, dtype=dtype)) is early


def test_the_load_starts_the_c_builds_before_it_converts_the_file(
    tmp_path: Path, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.support import tinymodels

    calls: list[str] = []
    for module, name in ((model.kernel, "start"), (model.attention, "start"), (model.sources, "materialize")):
        monkeypatch.setattr(
            module, name, recorded(f"{module.__name__.rsplit('.', 1)[1]}.{name}", getattr(module, name), calls)
        )
    gguf = tinymodels.build_gguf("qwen2", tmp_path)
    model.load_model(replace(settings, model=str(gguf), device="cpu"), StageClock())
    assert calls == ["kernel.start", "attention.start", "sources.materialize"]
    calls.clear()
    monkeypatch.setattr(model, "_plainly_cpu_fp32", lambda settings: False)  # as on a machine with a GPU's files
    model.load_model(replace(settings, model=str(gguf), device="auto"), StageClock())  # torch sees none: CPU
    assert calls == ["kernel.start", "attention.start", "sources.materialize"]


def recorded(name: str, function: Callable[..., object], calls: list[str]) -> Callable[..., object]:
    def call(*args: object, **kwargs: object) -> object:
        calls.append(name)
        return function(*args, **kwargs)

    return call


def test_prepare_starts_the_c_builds_before_it_converts_the_file(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ttft_sse.__main__ import _prepare

    class Converting(Exception):
        pass

    calls: list[str] = []

    def materialize(*args: object, **kwargs: object) -> None:
        calls.append("sources.materialize")
        raise Converting

    monkeypatch.setattr(model, "start_builds", recorded("model.start_builds", model.start_builds, calls))
    monkeypatch.setattr(model.sources, "materialize", materialize)
    with pytest.raises(Converting):
        _prepare(settings)
    assert calls == ["model.start_builds", "sources.materialize"]


def test_auto_rows_are_int8_for_a_file_of_2_gib_or_more_and_fp32_below_or_with_degrade(
    tmp_path: Path, settings: Settings
) -> None:
    large, small = tmp_path / "large.gguf", tmp_path / "small.gguf"
    with large.open("wb") as fh:
        fh.truncate(model.LARGE_FILE_BYTES)  # sparse: its size is what counts
    small.write_bytes(b"GGUF")
    auto = replace(settings, gguf_activations="auto")
    assert model.activations_for(auto, large) == "int8"
    assert model.activations_for(auto, small) == "fp32"
    assert model.activations_for(replace(auto, degrade="int8"), large) == "fp32"  # its switch needs fp32 rows
    assert model.activations_for(replace(settings, gguf_activations="fp32"), large) == "fp32"
    assert model.activations_for(replace(settings, gguf_activations="int8"), small) == "int8"
