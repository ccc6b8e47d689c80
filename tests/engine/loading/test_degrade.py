"""``TTFT_DEGRADE=int8`` where the int8 mode cannot exist: the engine refuses to load, with a sentence that says why
(engine/loading/model.py), before reading the model wherever the settings tell. Where it can, both arrangements are
held and the memory they take is logged."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from structlog.testing import capture_logs

from ttft_sse.engine.batched.engine import BatchedEngine
from ttft_sse.engine.kernels import arrangement, kernel
from ttft_sse.engine.kernels.compiler import KERNEL_DIR
from ttft_sse.engine.loading import sources
from ttft_sse.engine.single import SingleEngine
from ttft_sse.errors import StartupError
from ttft_sse.settings import Settings
from ttft_sse.stages import StageClock

REFUSED = "TTFT_DEGRADE=int8 cannot run here: "


@pytest.mark.parametrize("kind", [SingleEngine, BatchedEngine])
def test_without_the_block_kernel_the_engine_refuses_to_load(
    settings: Settings, kind: type[SingleEngine] | type[BatchedEngine]
) -> None:
    engine = kind(settings.replace(degrade="int8", gguf_kernel=False))
    with capture_logs() as logs, pytest.raises(StartupError) as refused:
        engine.load(StageClock())
    reason = "TTFT_GGUF_KERNEL=false turns off the block kernel, whose int8 rows it is"
    assert refused.value.message == f"{REFUSED}{reason}. Set TTFT_DEGRADE=off, or see docs/engine.md"
    assert [e for e in logs if e["log_level"] == "error"] == [
        {"event": "degrade_refused", "log_level": "error", "reason": reason}
    ]
    assert not [e for e in logs if e["event"] == "weights_blocks"]  # refused before the model was read


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"threads": 2}, "the block kernel runs on one torch thread, and TTFT_THREADS gives 2"),
        ({"dtype": "bfloat16"}, "it is the CPU block kernel's, for fp32 on CPU; the model runs on cpu in bfloat16"),
    ],
)
def test_settings_the_block_kernel_does_not_serve_are_refused(
    settings: Settings, changes: dict[str, Any], reason: str
) -> None:
    with pytest.raises(StartupError, match=f"^{REFUSED}{reason}. Set TTFT_DEGRADE=off"):
        SingleEngine(settings.replace(degrade="int8", **changes)).load(StageClock())


def test_a_model_that_is_not_a_gguf_is_refused(settings: Settings, tiny_models: Callable[[str], Path]) -> None:
    model = str(tiny_models("llama"))
    reason = f"it needs a GGUF model's quantised blocks, and {model!r} is a directory model"
    with pytest.raises(StartupError) as refused:
        SingleEngine(settings.replace(degrade="int8", model=model)).load(StageClock())
    assert refused.value.message.startswith(f"{REFUSED}{reason}. ")


def test_a_cpu_without_int8_rows_is_refused(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel, "takes_int8", lambda path: False)
    reason = "the CPU has neither AVX-512 VNNI nor AVX2 with F16C, which int8 rows need"
    with pytest.raises(StartupError, match=f"^{REFUSED}{reason}. "):
        SingleEngine(settings.replace(degrade="int8")).load(StageClock())


def test_int8_records_that_disagree_with_their_reference_are_refused(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not kernel.takes_int8(kernel.build(settings.cache_dir / KERNEL_DIR)):
        pytest.skip("the CPU has neither AVX-512 VNNI nor AVX2 with F16C")
    records = arrangement.records

    def wrong(codes: Any) -> Any:  # every code one step off: the int8 probe fails, the fp32 one does not
        made = records(codes)
        made[:, :, : made.shape[2] - 64] ^= np.uint8(1)
        return made

    monkeypatch.setattr(arrangement, "records", wrong)
    monkeypatch.setattr(arrangement, "load", lambda *_args: None)  # laid out now, as at a first start
    with pytest.raises(StartupError, match=f"^{REFUSED}the block kernel with int8 rows disagrees with its fp64"):
        SingleEngine(settings.replace(degrade="int8")).load(StageClock())
    folder = sources.model_dir(sources.bundled_gguf(), settings.cache_dir)
    assert not arrangement.path_for(folder, "fp32", True).exists()  # written as laid out, gone once refused


def test_with_degrade_both_arrangements_are_held_and_their_memory_logged(settings: Settings) -> None:
    if not kernel.takes_int8(kernel.build(settings.cache_dir / KERNEL_DIR)):
        pytest.skip("the CPU has neither AVX-512 VNNI nor AVX2 with F16C")
    engine = SingleEngine(settings.replace(degrade="int8"))
    with capture_logs() as logs:
        engine.load(StageClock())
    assert (engine.info.modes, engine.info.weights) == (("normal", "int8"), "gguf-blocks")
    (ready,) = [e for e in logs if e["event"] == "degrade_ready"]
    block = kernel.block_linear_class()
    layers = [m for m in engine.model.modules() if type(m) is block]
    mib = round(sum(m.records.numel() for m in layers) / 2**20, 1)
    assert ready == {
        "event": "degrade_ready",
        "log_level": "info",
        "modes": ["normal", "int8"],
        "int8_records_mib": mib,
        "layers": 211,
        "fused": 30,
    }
    assert 90 < mib < 100  # the bundled model's 4.5 and 8.5 bits an input, again
    (fused,) = [e for e in logs if e["event"] == "decoder_fused"]
    assert fused["int8_too"] is True and fused["one_call"] is True
