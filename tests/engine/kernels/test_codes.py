"""A GGUF file's own blocks read into codes (engine/kernels/codes.py)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.ggufs import KINDS, quantise, quantised
from ttft_sse.engine.kernels import codes

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")


FORMS = [  # type, bits, the codes' range, whether the zeros are nonzero
    ("Q4_0", 4, -8, 7, False),
    ("Q4_1", 4, -8, 7, True),
    ("Q5_0", 8, -16, 15, False),
    ("Q5_1", 8, -16, 15, True),
    ("Q8_0", 8, -127, 127, False),
    ("Q4_K", 4, -8, 7, True),
    ("Q5_K", 8, -16, 15, True),
    ("Q6_K", codes.SIXTEEN, -32, 31, False),
]


@pytest.mark.parametrize(("kind", "bits", "low", "high", "zeros"), FORMS)
def test_codes_give_back_the_weight_ggufs_own_dequantisation_gives(
    kind: str, bits: int, low: int, high: int, zeros: bool
) -> None:
    blocks, want = quantised((48, 512), kind)  # two K-quant super-blocks a row
    found = codes.decode(blocks, int(KINDS[kind]), (48, 512))
    assert found.q.shape == (48, 512) and found.q.dtype == np.int8 and found.bits == bits
    assert (int(found.q.min()), int(found.q.max())) == (low, high)  # every code is used
    scales = (48, 512 // found.group)  # Q6_K's cover 16 inputs
    assert found.scale.shape == found.zero.shape == scales and found.scale.dtype == found.zero.dtype == np.float32
    assert found.dense().tobytes() == want.tobytes()  # every bit, the sign of zero too
    assert np.any(found.zero) == zeros


@pytest.mark.parametrize("kind", [kind for kind, *_ in FORMS])
def test_blocks_of_zeros_keep_ggufs_sign_of_zero(kind: str) -> None:
    """A row of zeros (a padded vocabulary's) and a block of zeros: gguf's d*q + m (or - dmin*m) is +0.0 there, its
    d*(q-8) of Q4_0 and Q5_0 -0.0 where d < 0. A zero of +0.0 added to a code's -0.0 gives the first, a zero of
    -0.0 the second: the layer is matched either way."""
    data = (np.random.default_rng(0).standard_normal((16, 256)) * 0.02).astype(np.float32)
    data[3], data[5, 32:64] = 0, 0
    blocks, want = quantise(data, kind)
    found = codes.decode(blocks, int(KINDS[kind]), (16, 256))
    assert found.dense().tobytes() == want.tobytes()
    assert np.all(want[3] == 0) and np.all(want[5, 32:64] == 0)
    # Q4_0's and Q5_0's d = largest / -8 or -16; Q6_K's d*sc is negative where a group's largest value is positive
    assert np.any(np.signbit(want) & (want == 0)) == (kind in ("Q4_0", "Q5_0", "Q6_K"))


@pytest.mark.parametrize("sigma", [0.02, 1.0])
@pytest.mark.parametrize("kind", ["Q5_1", "Q4_K", "Q5_K"])
def test_the_zeros_are_exact_for_weights_of_any_usual_size(kind: str, sigma: float) -> None:
    """The zero m + 16d (Q5_1) or middle*d*sc - dmin*m (K-quants) is rounded to fp32: exact, so the weights are
    gguf's bit for bit, where the values it adds are of similar size, as in quantised weights."""
    for seed in range(4):
        blocks, want = quantised((64, 1024), kind, seed=seed, sigma=sigma)
        assert codes.decode(blocks, int(KINDS[kind]), (64, 1024)).dense().tobytes() == want.tobytes()


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_packed_codes_are_the_files_own_bytes_and_unpack_to_the_same_codes(kind: str) -> None:
    blocks, _ = quantised((8, 64), kind)
    found = codes.decode(blocks, int(KINDS[kind]), (8, 64))
    packed = found.packed()
    raw = np.asarray(blocks).reshape(8, 2, codes.FORMATS[int(KINDS[kind])].size)
    header = raw.shape[-1] - codes.BLOCK * found.bits // 8  # d (and m): the codes come last in a block
    assert packed.tobytes() == np.ascontiguousarray(raw[..., header:]).tobytes()
    again = codes.Codes.unpacked(packed, found.scale, found.zero, found.bits)
    assert again.q.dtype == np.int8 and np.array_equal(again.q, found.q)


@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_packed_codes_of_the_other_types_unpack_to_the_same_codes(kind: str) -> None:
    blocks, _ = quantised((8, 256), kind)
    found = codes.decode(blocks, int(KINDS[kind]), (8, 256))
    packed = found.packed()
    assert packed.shape == (8, 256 * (4 if found.bits == 4 else 8) // 8)
    again = codes.Codes.unpacked(packed, found.scale, found.zero, found.bits)
    assert again.q.dtype == np.int8 and np.array_equal(again.q, found.q)
