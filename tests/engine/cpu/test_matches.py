"""Which layers a GGUF file holds, in which type, found again by their rows, and kept (engine/cpu/matches.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from structlog.testing import capture_logs

from tests.support.ggufs import KINDS, layers_of, quantised, write_gguf
from ttft_sse.engine.cpu import codes, matches

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K"])
def test_a_k_quant_whose_zero_is_not_exact_is_not_matched(kind: str) -> None:
    """A super-block of d = 1, dmin = 2**-24 (fp16's least), every sc and m 1 and every code 0: gguf's weight is
    1*0 - 2**-24, but the zero 8 - 2**-24 (16 - 2**-24 for Q5_K) rounds to 8 in fp32, so the codes give -8 + 8 = 0.
    The layer holding it keeps its type and gets no codes: it stays fp32."""
    blocks, _ = quantised((16, 256), kind)
    blocks = blocks.copy()
    crafted = np.zeros(blocks.shape[1], np.uint8)  # codes (and Q5_K's fifth bits) 0
    crafted[0:4] = np.array([1.0, 2.0**-24], np.float16).view(np.uint8)  # d, dmin
    crafted[4:8] = crafted[8:12] = 1  # sc and m of blocks 0-3 (their top 2 bits, blocks 4-7's, 0)
    crafted[12:16] = 0x11  # sc and m of blocks 4-7, low 4 bits
    blocks[0] = crafted
    want = gguf.quants.dequantize(blocks, KINDS[kind]).astype(np.float32)
    found = codes.decode(blocks, int(KINDS[kind]), (16, 256))
    assert np.all(want[0] == -(2.0**-24)) and np.all(found.dense()[0] == 0)
    assert found.dense()[1:].tobytes() == want[1:].tobytes()
    assert matches._match(want, matches._index([matches.Stored(kind, want[:, :64], found)])) == (kind, None)


@pytest.mark.parametrize("column", [5, 100], ids=["hashed-column", "column-past-the-hash"])
def test_a_weight_is_matched_in_any_row_order_and_only_when_every_bit_agrees(column: int) -> None:
    blocks, dense = quantised((64, 128), "Q4_1")
    found = codes.decode(blocks, int(KINDS["Q4_1"]), (64, 128))
    candidates = matches._index([matches.Stored("Q4_1", dense[:, :64], found)])
    assert matches.HASHED_COLUMNS == 64  # column 5 changes the row's hash, column 100 only the full comparison

    order = np.random.default_rng(1).permutation(64)
    kind, matched = matches._match(dense[order], candidates)
    assert kind == "Q4_1" and matched is not None and matched.dense().tobytes() == dense[order].tobytes()

    changed = dense.copy()
    changed[3, column] = np.nextafter(changed[3, column], np.float32(np.inf))  # one bit off
    # Its rows are still known by their hashes where the change is past them: its type, without codes.
    assert matches._match(changed, candidates) == ("Q4_1" if column >= 64 else matches.UNKNOWN, None)
    assert matches._match(np.zeros((64, 128), np.float32), candidates) == (matches.UNKNOWN, None)


def test_of_layers_finds_the_layers_the_file_holds_as_blocks(tmp_path: Path) -> None:
    layers, path = layers_of(tmp_path)
    found = matches.of_layers(layers, path, None)
    assert found.kinds == {"up": "Q4_1", "down": "Q8_0", "other": "F32"}
    assert {name: c.bits for name, c in found.codes.items()} == {"up": 4, "down": 8, "other": codes.FULL}
    for name, got in found.codes.items():
        assert got.dense().tobytes() == layers[name].weight.detach().numpy().tobytes()


def k_quant_layers(tmp_path: Path) -> tuple[dict[str, Any], Path]:
    """Layers whose weights a file holds as Q4_K, Q5_K, Q5_0, Q5_1, Q6_K, F16 and BF16 (the Q5_K and Q6_K rows
    reordered), and a Q4_K one it does not hold (another weight, quantised with another seed)."""
    path = tmp_path / "k.gguf"
    tensors, layers = {}, {}
    for seed, kind in enumerate(["Q4_K", "Q5_K", "Q5_0", "Q5_1", "Q6_K"]):
        blocks, dense = quantised((32, 256), kind, seed=seed, sigma=0.02)
        tensors[kind.lower()] = (blocks, kind)
        layers[kind.lower()] = dense[::-1].copy() if kind in ("Q5_K", "Q6_K") else dense
    half = np.random.default_rng(9).standard_normal((32, 256)).astype(np.float16)
    tensors["f16"] = (half, "F16")
    layers["f16"] = half.astype(np.float32)
    blocks, layers["bf16"] = quantised((32, 256), "BF16", seed=7)
    tensors["bf16"] = (blocks, "BF16")
    layers["elsewhere"] = quantised((32, 256), "Q4_K", seed=99, sigma=0.02)[1]
    write_gguf(path, tensors)
    linears = {}
    for name, weight in layers.items():
        linears[name] = torch.nn.Linear(256, 32, bias=False)
        with torch.no_grad():
            linears[name].weight.copy_(torch.from_numpy(weight))
    return linears, path


def test_of_layers_finds_every_layers_type_and_the_codes_of_those_the_kernel_runs(tmp_path: Path) -> None:
    layers, path = k_quant_layers(tmp_path)
    found = matches.of_layers(layers, path, None)
    assert found.kinds == {
        "q4_k": "Q4_K",
        "q5_k": "Q5_K",
        "q5_0": "Q5_0",
        "q5_1": "Q5_1",
        "q6_k": "Q6_K",
        "f16": "F16",
        "bf16": "BF16",
        "elsewhere": matches.UNKNOWN,
    }
    bits = {name: c.bits for name, c in found.codes.items()}
    assert bits == {
        "q4_k": 4,
        "q5_k": 8,
        "q5_0": 8,
        "q5_1": 8,
        "q6_k": codes.SIXTEEN,
        "f16": codes.HALF,
        "bf16": codes.BRAIN,
    }
    for name, got in found.codes.items():
        assert got.dense().tobytes() == layers[name].weight.detach().numpy().tobytes()
    assert matches.why_not("Q3_K") == "no kernel layout for 16-input scales and minimums"
    assert matches.why_not("F16") == "its values do not give back the loaded weight bit for bit"
    assert matches.why_not(matches.UNKNOWN) == "no matrix of the file holds its rows"


def test_the_codes_are_kept_for_the_next_start_which_does_not_read_the_file_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    layers, path = layers_of(tmp_path)
    cache = tmp_path / "converted" / matches.CACHE_FILE
    cache.parent.mkdir()
    first = matches.of_layers(layers, path, cache)
    assert cache.is_file() and not list(cache.parent.glob("*.partial*"))

    monkeypatch.setattr(matches, "read", lambda _path: pytest.fail("the file was read again"))
    second = matches.of_layers(layers_of(tmp_path)[0], path, cache)
    assert second.kinds == first.kinds == {"up": "Q4_1", "down": "Q8_0", "other": "F32"}
    assert sorted(second.codes) == sorted(first.codes)
    for name, got in second.codes.items():
        assert got.bits == first.codes[name].bits and np.array_equal(got.q, first.codes[name].q)
        assert got.dense().tobytes() == first.codes[name].dense().tobytes()


def test_kept_k_quant_codes_give_back_the_same_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    layers, path = k_quant_layers(tmp_path)
    cache = tmp_path / matches.CACHE_FILE
    first = matches.of_layers(layers, path, cache)
    monkeypatch.setattr(matches, "read", lambda _path: pytest.fail("the file was read again"))
    second = matches.of_layers(layers, path, cache)
    assert second.kinds == first.kinds and sorted(second.codes) == sorted(first.codes)
    for name, got in second.codes.items():
        assert got.dense().tobytes() == layers[name].weight.detach().numpy().tobytes()
        # a K-quant's own factors are kept too (the kernel's compact panels), the same values
        assert (got.factors is not None) == (first.kinds[name] in ("Q4_K", "Q5_K"))
        if got.factors is not None:
            assert first.codes[name].factors is not None
            pairs = zip(got.factors, first.codes[name].factors, strict=True)
            assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in pairs)


def test_a_cache_without_the_layers_types_is_matched_again_and_rewritten(tmp_path: Path) -> None:
    """As starts wrote it before the types were kept: codes alone."""
    layers, path = layers_of(tmp_path)
    cache = tmp_path / matches.CACHE_FILE
    matches.of_layers(layers, path, cache)
    with np.load(cache) as saved:
        old = {key: saved[key] for key in saved.files if not key.endswith(".kind")}
    np.savez(cache, **old)
    assert matches._load_cached(cache, layers) is None
    assert matches.of_layers(layers, path, cache).kinds["up"] == "Q4_1"
    assert matches._load_cached(cache, layers) is not None


def test_a_cache_that_no_longer_fits_the_weights_is_matched_again_and_rewritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    layers, path = layers_of(tmp_path)
    cache = tmp_path / matches.CACHE_FILE
    matches.of_layers(layers, path, cache)

    def flipped() -> dict[str, Any]:  # as if the loader now gave another row order
        other, _ = layers_of(tmp_path)
        with torch.no_grad():
            other["up"].weight.copy_(other["up"].weight.flip(0))
        return other

    changed = flipped()
    found = matches.of_layers(changed, path, cache)
    assert found.codes["up"].dense().tobytes() == changed["up"].weight.detach().numpy().tobytes()

    monkeypatch.setattr(matches, "read", lambda _path: pytest.fail("the rewritten cache was not used"))
    again = matches.of_layers(flipped(), path, cache)
    assert again.codes["up"].dense().tobytes() == found.codes["up"].dense().tobytes()


def test_an_unreadable_cache_is_ignored_with_a_warning(tmp_path: Path) -> None:
    cache = tmp_path / matches.CACHE_FILE
    cache.write_bytes(b"not a zip")
    with capture_logs() as logs:
        assert matches._load_cached(cache, {}) is None
    assert [entry["event"] for entry in logs] == ["codes_cache_unreadable"]


def test_the_account_lists_each_path_a_types_layers_take() -> None:
    kinds = {"a": "Q4_K", "b": "BF16", "c": "Q4_K", "d": "Q6_K", "e": matches.UNKNOWN, "f": "Q8_0", "g": "Q3_K"}
    kinds["h"] = "BF16"
    rows = {"a": "int8", "b": "fp32", "d": "int8", "f": "int8"}
    assert matches.by_type(kinds, rows, "int8") == {
        "BF16": "blocks, fp32 rows: 1 (not quantised: int8 rows multiply quantised blocks); "
        "fp32: 1 (its values do not give back the loaded weight bit for bit)",
        "Q4_K": "blocks, int8 rows: 1; fp32: 1 (its blocks do not give back the loaded weight bit for bit)",
        "Q3_K": "fp32: 1 (no kernel layout for 16-input scales and minimums)",
        "Q6_K": "blocks, int8 rows: 1",
        "Q8_0": "blocks, int8 rows: 1",
        "unknown": "fp32: 1 (no matrix of the file holds its rows)",
    }
