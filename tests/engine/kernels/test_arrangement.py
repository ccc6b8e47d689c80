"""The block kernel's laid-out arrays kept for the next start (engine/kernels/arrangement.py), through kernel.apply."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from structlog.testing import capture_logs

from tests.engine.kernels.test_kernel import DIRECTORY, one_thread, skip_without_int8, tiny_model
from tests.support.ggufs import sequential
from ttft_sse.engine.kernels import arrangement, kernel
from ttft_sse.engine.kernels.stored import Stored

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")

__all__ = ["one_thread"]  # the kernel runs on one torch thread (an autouse fixture)

X = torch.from_numpy(np.random.default_rng(3).standard_normal((5, 64)).astype(np.float32))


def model_of(tmp_path: Path) -> tuple[Any, Any]:
    """The tiny model of tests/engine/kernels/test_kernel.py, with the same biases at every start."""
    torch.manual_seed(0)
    return tiny_model(tmp_path)


def start(tmp_path: Path, activations: str = "fp32", degrade: bool = False) -> tuple[Any, kernel.Applied, list[Any]]:
    """A start of the tiny model: applied with the codes' cache in ``tmp_path``; its output for :data:`X`."""
    model, stored = model_of(tmp_path)
    with capture_logs() as logs:
        applied = kernel.apply(
            model,
            stored,
            torch,
            directory=DIRECTORY,
            cache=tmp_path,
            activations=activations,
            degrade=degrade,
        )
    with torch.no_grad():
        return model(X), applied, logs


def no_codes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Stored, "codes", lambda *_args: pytest.fail("the codes were read and laid out again"))


def kept_file(tmp_path: Path, activations: str = "fp32", degrade: bool = False) -> Path:
    return arrangement.path_for(tmp_path, activations, degrade)


@pytest.mark.parametrize(("activations", "degrade"), [("fp32", False), ("int8", False), ("fp32", True)])
def test_a_later_start_maps_the_kept_arrays_and_computes_the_same_bits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, activations: str, degrade: bool
) -> None:
    if activations == "int8" or degrade:
        skip_without_int8()
    first, applied, logs = start(tmp_path, activations, degrade)
    assert [entry["event"] for entry in logs] == ["arrangement_kept", "weights_blocks"]
    assert kept_file(tmp_path, activations, degrade).is_file()
    assert not list(tmp_path.glob(".*partial*"))

    no_codes(monkeypatch)
    model, stored = model_of(tmp_path)
    with capture_logs() as logs:
        again = kernel.apply(
            model,
            stored,
            torch,
            directory=DIRECTORY,
            cache=tmp_path,
            activations=activations,
            degrade=degrade,
        )
    assert [entry["event"] for entry in logs] == ["weights_blocks"]
    assert again == applied
    assert [type(layer).__name__ for layer in model] == ["BlockLinear"] * 3  # Q4_1, Q8_0 and F32 (dense)
    assert (model[0].records is not None) is degrade
    assert model[2].records is None  # dense: fp32 rows in every mode
    with torch.no_grad():
        second = model(X)
        if degrade:
            with kernel.int8_rows():
                assert not torch.equal(model(X), second)  # the kept records are in use
    assert torch.equal(first, second)


def test_each_arrangement_has_its_own_file(tmp_path: Path) -> None:
    skip_without_int8()
    start(tmp_path, "fp32")
    start(tmp_path, "int8")
    assert kept_file(tmp_path, "fp32").read_bytes() != kept_file(tmp_path, "int8").read_bytes()


def test_the_key_covers_the_kernel_the_rows_the_degraded_mode_and_the_layouts_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    library = Path("blocks-0123456789abcdef.so")  # named by the kernel's source, compiler, flags and CPU flags
    base = arrangement.key(library, "fp32", False)
    assert base == arrangement.key(library, "fp32", False)
    others = [
        arrangement.key(Path("blocks-fedcba9876543210.so"), "fp32", False),
        arrangement.key(library, "int8", False),
        arrangement.key(library, "fp32", True),
    ]
    changed = tmp_path / "layouts.py"
    changed.write_bytes(arrangement._SOURCES[0].read_bytes() + b"\n# another layout\n")
    monkeypatch.setattr(arrangement, "_SOURCES", (changed, *arrangement._SOURCES[1:]))
    others.append(arrangement.key(library, "fp32", False))
    assert len({base, *others}) == 5


def break_key(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(arrangement, "FORMAT", arrangement.FORMAT + 1)  # as a new layout or kernel would


def flip_a_byte(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = bytearray(path.read_bytes())
    data[arrangement.ALIGN + 100] ^= 0x10  # in the first layer's arrays
    path.write_bytes(bytes(data))


def truncate(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path.write_bytes(path.read_bytes()[:-64])


def garbage(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path.write_bytes(b"not an arrangement at all")


def broken_header(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = bytearray(path.read_bytes())
    data[-30:-20] = b"}}}}}}}}}}"  # in the header, at the file's end
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("spoil", "reason"),
    [
        (break_key, "written for another layout, kernel or CPU"),
        (flip_a_byte, "checksum mismatch"),
        (truncate, "truncated or extended"),
        (garbage, "not an arrangement file"),
        (broken_header, "unreadable: JSONDecodeError"),
    ],
    ids=["stale-key", "flipped-byte", "truncated", "garbage", "broken-header"],
)
def test_a_stale_or_corrupt_file_is_never_used_but_laid_out_again_and_rewritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spoil: Any, reason: str
) -> None:
    want, applied, _ = start(tmp_path)
    path = kept_file(tmp_path)
    spoil(path, monkeypatch)
    got, again, logs = start(tmp_path)
    rebuilt = [entry for entry in logs if entry["event"] == "arrangement_rebuilt"]
    assert len(rebuilt) == 1 and rebuilt[0]["reason"].startswith(reason), rebuilt
    assert [entry["event"] for entry in logs] == ["arrangement_rebuilt", "arrangement_kept", "weights_blocks"]
    assert torch.equal(got, want) and again == applied

    no_codes(monkeypatch)  # rewritten: the next start maps it
    third, _, logs = start(tmp_path)
    assert [entry["event"] for entry in logs] == ["weights_blocks"] and torch.equal(third, want)


def test_a_file_kept_for_other_weights_is_laid_out_again(tmp_path: Path) -> None:
    """As if the loader now gave another row order: the kept rows' checksum no longer matches the weight."""
    start(tmp_path)
    model, _ = model_of(tmp_path)
    stored = sequential(tmp_path / "tiny.gguf")  # the first layer's rows in the file's order, not reversed
    with torch.no_grad():
        model[0].weight.copy_(model[0].weight.flip(0))
        want = model(X)
    with capture_logs() as logs:
        kernel.apply(model, stored, torch, directory=DIRECTORY, cache=tmp_path)
    assert logs[0]["event"] == "arrangement_rebuilt" and logs[0]["reason"] == "written for another weight of 0"
    with torch.no_grad():
        assert float((model(X) - want).abs().max()) <= 1e-5 * float(want.abs().max())


def test_an_unwritable_directory_is_logged_and_the_start_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise PermissionError("read-only file system")

    monkeypatch.setattr(Path, "replace", refuse)
    _, applied, logs = start(tmp_path)
    events = ["arrangement_not_written", "weights_blocks"]
    assert [entry["event"] for entry in logs] == events
    assert applied.activations == "fp32" and not kept_file(tmp_path).exists()
    assert not list(tmp_path.glob(".*partial*"))
