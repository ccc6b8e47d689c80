"""A GGUF file's own blocks found behind the fp32 weights transformers loaded (engine/cpu/codes.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from structlog.testing import capture_logs

from tests.support.ggufs import KINDS, layers_of, quantised
from ttft_sse.engine.cpu import codes

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")


@pytest.mark.parametrize(
    ("kind", "bits", "low", "high"), [("Q4_0", 4, -8, 7), ("Q4_1", 4, -8, 7), ("Q8_0", 8, -127, 127)]
)
def test_codes_give_back_the_weight_ggufs_own_dequantisation_gives(kind: str, bits: int, low: int, high: int) -> None:
    blocks, want = quantised((48, 96), kind)
    found = codes.decode(blocks, int(KINDS[kind]), (48, 96))
    assert found.q.shape == (48, 96) and found.q.dtype == np.int8 and found.bits == bits
    assert int(found.q.min()) >= low and int(found.q.max()) <= high
    assert found.scale.shape == found.zero.shape == (48, 3)
    assert found.dense().tobytes() == want.tobytes()  # every bit, the sign of zero too
    assert np.any(found.zero) == (kind == "Q4_1")


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_packed_codes_are_the_files_own_bytes_and_unpack_to_the_same_codes(kind: str) -> None:
    blocks, _ = quantised((8, 64), kind)
    found = codes.decode(blocks, int(KINDS[kind]), (8, 64))
    packed = found.packed()
    raw = np.asarray(blocks).reshape(8, 2, codes.BLOCK_BYTES[int(KINDS[kind])])
    header = raw.shape[-1] - codes.BLOCK * found.bits // 8  # d (and m): the codes come last in a block
    assert packed.tobytes() == np.ascontiguousarray(raw[..., header:]).tobytes()
    again = codes.Codes.unpacked(packed, found.scale, found.zero, found.bits)
    assert again.q.dtype == np.int8 and np.array_equal(again.q, found.q)


@pytest.mark.parametrize("column", [5, 100], ids=["hashed-column", "column-past-the-hash"])
def test_a_weight_is_matched_in_any_row_order_and_only_when_every_bit_agrees(column: int) -> None:
    blocks, dense = quantised((64, 128), "Q4_1")
    found = codes.decode(blocks, int(KINDS["Q4_1"]), (64, 128))
    candidates = codes._index([found])
    assert codes.HASHED_COLUMNS == 64  # column 5 changes the row's hash, column 100 only the full comparison

    order = np.random.default_rng(1).permutation(64)
    matched = codes._match(dense[order], candidates)
    assert matched is not None and matched.dense().tobytes() == dense[order].tobytes()

    changed = dense.copy()
    changed[3, column] = np.nextafter(changed[3, column], np.float32(np.inf))  # one bit off
    assert codes._match(changed, candidates) is None
    assert codes._match(np.zeros((64, 128), np.float32), candidates) is None


def test_of_layers_finds_the_layers_the_file_holds_as_blocks(tmp_path: Path) -> None:
    layers, path = layers_of(tmp_path)
    found = codes.of_layers(layers, path, None)
    assert sorted(found) == ["down", "up"] and (found["up"].bits, found["down"].bits) == (4, 8)
    for name, got in found.items():
        assert got.dense().tobytes() == layers[name].weight.detach().numpy().tobytes()


def test_the_codes_are_kept_for_the_next_start_which_does_not_read_the_file_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    layers, path = layers_of(tmp_path)
    cache = tmp_path / "converted" / codes.CACHE_FILE
    cache.parent.mkdir()
    first = codes.of_layers(layers, path, cache)
    assert cache.is_file() and not list(cache.parent.glob("*.partial*"))

    monkeypatch.setattr(codes, "read", lambda _path: pytest.fail("the file was read again"))
    second = codes.of_layers(layers_of(tmp_path)[0], path, cache)
    assert sorted(second) == sorted(first)
    for name, got in second.items():
        assert got.bits == first[name].bits and np.array_equal(got.q, first[name].q)
        assert got.dense().tobytes() == first[name].dense().tobytes()


def test_a_cache_that_no_longer_fits_the_weights_is_matched_again_and_rewritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    layers, path = layers_of(tmp_path)
    cache = tmp_path / codes.CACHE_FILE
    codes.of_layers(layers, path, cache)

    def flipped() -> dict[str, Any]:  # as if the loader now gave another row order
        other, _ = layers_of(tmp_path)
        with torch.no_grad():
            other["up"].weight.copy_(other["up"].weight.flip(0))
        return other

    changed = flipped()
    found = codes.of_layers(changed, path, cache)
    assert found["up"].dense().tobytes() == changed["up"].weight.detach().numpy().tobytes()

    monkeypatch.setattr(codes, "read", lambda _path: pytest.fail("the rewritten cache was not used"))
    again = codes.of_layers(flipped(), path, cache)
    assert again["up"].dense().tobytes() == found["up"].dense().tobytes()


def test_an_unreadable_cache_is_ignored_with_a_warning(tmp_path: Path) -> None:
    cache = tmp_path / codes.CACHE_FILE
    cache.write_bytes(b"not a zip")
    with capture_logs() as logs:
        assert codes._load_cached(cache, {}) is None
    assert [entry["event"] for entry in logs] == ["codes_cache_unreadable"]
