"""The block kernel: fp32 rows, or rows quantised to int8, times a GGUF file's own blocks (engine/kernels/kernel.py,
engine/kernels/kernel.c)."""

from __future__ import annotations

import ctypes
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from structlog.testing import capture_logs

from tests.support import builds
from tests.support.engines import collect, prompt_of
from tests.support.ggufs import KINDS, layers_of, quantised, sequential, write_gguf
from tests.support.paths import CACHE_DIR
from tests.support.texts import PASSAGE
from ttft_sse.engine.base import SamplingParams
from ttft_sse.engine.batched.engine import BatchedEngine
from ttft_sse.engine.kernels import attention, codes, compiler, kernel, layouts
from ttft_sse.engine.kernels.compiler import KERNEL_DIR
from ttft_sse.engine.kernels.layouts import records
from ttft_sse.engine.single import SingleEngine
from ttft_sse.settings import Settings
from ttft_sse.stages import StageClock

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

DIRECTORY = CACHE_DIR / KERNEL_DIR  # the one the engine builds in: built once for the whole run


@pytest.fixture(autouse=True)
def one_thread() -> Any:
    """The kernel is applied only with one torch thread (as the suite's engines run)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def skip_without_int8() -> None:
    """Int8 rows are built for CPUs with AVX-512 VNNI or AVX2 and F16C (elsewhere the engine keeps fp32 rows and
    says so: the test of that runs everywhere)."""
    if not kernel.takes_int8(kernel.build(DIRECTORY)):
        pytest.skip("the CPU has neither AVX-512 VNNI nor AVX2 with F16C: the kernel has no int8 rows here")


def block_layer(
    kind: str, shape: tuple[int, int], library: Path | None = None, activations: str = "fp32"
) -> tuple[Any, np.ndarray]:
    """A linear layer on the kernel (``library``, else this CPU's build) with a random ``shape`` weight quantised as
    ``kind``; and its fp32 weight."""
    blocks, dense = quantised(shape, kind)
    return block_layer_from(blocks, kind, shape, library or kernel.build(DIRECTORY), activations), dense


def block_layer_from(blocks: np.ndarray, kind: str, shape: tuple[int, int], library: Path, activations: str) -> Any:
    """A linear layer on the kernel of ``library`` with gguf's blocks ``blocks``."""
    if activations == "int8":
        skip_without_int8()
    layer = torch.nn.Linear(shape[1], shape[0], bias=False)
    kernel._attach(layer, codes.decode(blocks, int(KINDS[kind]), shape), library, activations, torch)
    return layer


def int8_steps(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows as the int8 kernel quantises them, as llama.cpp's Q8_0 does: each block of 32 inputs as whole steps
    (rows x blocks x 32), rounded (halves to even) from x * (127 / max|x|) in fp32, and the step d = max|x| / 127 in
    fp32 (rows x blocks)."""
    blocks = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    largest = np.abs(blocks).max(axis=-1)
    inverse = np.divide(np.float32(127), largest, out=np.zeros_like(largest), where=largest > 0)
    steps = np.rint(blocks * inverse[..., None]).astype(np.int64)
    assert np.abs(steps).max() <= 127
    return steps, largest / np.float32(127)


def rows_as_int8(x: np.ndarray) -> np.ndarray:
    """What the int8 kernel multiplies, in fp64: each block's steps times its d."""
    steps, d = int8_steps(x)
    return (steps.astype(np.float64) * d[..., None].astype(np.float64)).reshape(x.shape)


@pytest.fixture(scope="module")
def avx2_build() -> Path:
    """The kernel's AVX2 side, built without AVX-512 (what a CPU without it gets)."""
    return builds.built(kernel.build, "-mno-avx512f")


@pytest.fixture(scope="module")
def no_f16c_build() -> Path:
    """The AVX2 side without F16C too: it widens fp16 weights in plain C."""
    return builds.built(kernel.build, "-mno-avx512f", "-mno-f16c")


@pytest.fixture(scope="module")
def no_vbmi_build() -> Path:
    """The AVX-512 side without VBMI (a CPU before Ice Lake or Zen 4): Q6_K's codes stay in 8 bits."""
    return builds.built(kernel.build, "-mno-avx512vbmi")


def cpu_has(flag: bytes) -> bool:
    return flag in compiler.cpu_features().split()


@pytest.mark.parametrize("build", ["native", "no-vbmi", "avx2", "no-f16c"])
def test_q6_k_panels_hold_a_factor_and_a_byte_for_each_scale_and_with_vbmi_six_bit_codes_for_the_same_bits(
    build: str, no_vbmi_build: Path, avx2_build: Path, no_f16c_build: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Q6_K's scales (d*sc each 16 inputs) are held as an fp32 factor a super-block of 256 inputs and a signed byte
    each 16 (SIX_SCALES), and on a build with AVX-512 VBMI its codes in 6 bits too (SIX_PACKED); each output is the
    same bits as from 8-bit codes and fp32 scales, on calls of one row, of a tile and through the buffer."""
    library = {"no-vbmi": no_vbmi_build, "avx2": avx2_build, "no-f16c": no_f16c_build}.get(build) or kernel.build(
        DIRECTORY
    )
    six = build == "native" and cpu_has(b"avx512vbmi") and cpu_has(b"avx512bw")
    assert kernel.takes_six(library) is six
    short, _ = block_layer("Q6_K", (70, 512), library)
    monkeypatch.setattr(layouts, "six_factors", lambda codes: None)
    full, _ = block_layer("Q6_K", (70, 512), library)
    flag = layouts.SIX_PACKED if six else layouts.SIX_SCALES
    assert (short.panel_bits, full.panel_bits) == (codes.SIXTEEN + flag, codes.SIXTEEN)
    held = [sum(a.numel() * a.element_size() for a in layer.arrays) for layer in (full, short)]
    # 5 panels of 512 inputs: 8-bit codes 8192 bytes a panel (6-bit: 6144), fp32 scales 2048 (two records: 640)
    assert held == [5 * (8192 + 2048), 5 * ((6144 if six else 8192) + 640)]
    x = torch.randn(24, 512)
    with torch.no_grad():
        for rows in (1, 3, 24):  # one row, a tile, the buffer
            assert torch.equal(short(x[:rows]), full(x[:rows])), rows


def test_q6_k_factors_are_found_for_any_d_and_sc_and_checked_exact() -> None:
    """The factor is the super-block's largest scale over its sc, whatever sc that is (llama.cpp's quantiser makes
    it -128; random blocks any byte); a scale no factor times a byte gives exactly (here one halved to a value of
    more bits) leaves the layer's scales in fp32."""
    rng = np.random.default_rng(3)
    d = (rng.random((32, 2)) * 1e-3 + 1e-4).astype(np.float16).astype(np.float32)
    sc = rng.integers(-100, 100, (32, 32)).astype(np.int8)
    sc[:, 0] = 0  # and a block of scale zero
    scale = np.repeat(d, 16, axis=1) * sc.astype(np.float32)
    found = codes.Codes(np.zeros((32, 512), np.int8), scale, np.full_like(scale, -0.0), codes.SIXTEEN)
    factors = layouts.six_factors(found)
    assert factors is not None
    factor, signed = factors
    assert np.array_equal(np.repeat(factor, 16, axis=1) * signed.astype(np.float32), scale)
    odd = scale.copy()
    odd[5, 7] = np.nextafter(odd[5, 7], np.float32(1))  # no byte times any factor
    assert layouts.six_factors(codes.Codes(found.q, odd, found.zero, codes.SIXTEEN)) is None
    laid, scales, _ = layouts.panels(codes.Codes(found.q, odd, found.zero, codes.SIXTEEN), six=True)
    assert (layouts.panel_bits(codes.SIXTEEN, scales, laid), scales.dtype) == (codes.SIXTEEN, np.float32)


def test_q5_codes_lie_in_five_bits_two_inputs_a_record_and_other_8_bit_codes_stay_in_eight() -> None:
    """Each two inputs' 20 bytes: byte n their ``q + 16``'s low nibbles for output n (the first input's low), then
    each input's fifth bits as a little-endian uint16, bit n output n's. Codes outside -16..15 (Q8_0's) keep 8 bits,
    and so do all for a kernel without the 5-bit layout (``five`` False)."""
    rng = np.random.default_rng(5)
    q = rng.integers(-16, 16, (16, 64)).astype(np.int8)
    q[3, 5], q[4, 6] = -16, 15
    found = codes.Codes(q, np.ones((16, 2), np.float32), np.full((16, 2), -0.0, np.float32), 8)
    laid, scales, _ = layouts.panels(found, five=True)
    assert laid.shape == (1, 32, layouts.FIVE_PAIR) and layouts.panel_bits(8, scales, laid) == layouts.FIVE + 128
    assert layouts.panels(found)[0].shape == (1, 64, 16)
    u = (q.astype(np.int16) + 16).astype(np.uint8)
    for j in (0, 2, 3, 31):
        record = laid[0, j]
        assert np.array_equal(record[:16] & 0x0F, u[:, 2 * j] & 0x0F)
        assert np.array_equal(record[:16] >> 4, u[:, 2 * j + 1] & 0x0F)
        words = record[16:].view("<u2")
        for input_, word in zip((2 * j, 2 * j + 1), words, strict=True):
            assert [(int(word) >> n) & 1 for n in range(16)] == (u[:, input_] >> 4).tolist()
    wide = codes.Codes(q.copy(), found.scale, found.zero, 8)
    wide.q[0, 0] = 16
    assert not layouts.fits_five(wide) and layouts.panels(wide, five=True)[0].shape == (1, 64, 16)


@pytest.mark.parametrize("build", ["native", "no-vbmi", "avx2", "no-f16c"])
def test_only_an_avx512_build_takes_the_q5_types_in_five_bits(
    build: str, no_vbmi_build: Path, avx2_build: Path, no_f16c_build: Path
) -> None:
    """AVX-512 unpacks 5-bit codes in a few instructions; AVX2 took 1.8x 8-bit codes' time a row, so its builds hold
    the Q5 types in 8 bits. Either way a Q5_0 layer is on the kernel with the file's fp16 scales."""
    library = {"no-vbmi": no_vbmi_build, "avx2": avx2_build, "no-f16c": no_f16c_build}.get(build) or kernel.build(
        DIRECTORY
    )
    five = build in ("native", "no-vbmi") and cpu_has(b"avx512f")
    assert kernel.takes_five(library) is five
    layer, _ = block_layer("Q5_0", (70, 512), library)
    assert layer.panel_bits == (layouts.FIVE if five else 8) + layouts.F16_SCALES


@pytest.mark.parametrize("build", ["native", "avx2", "no-f16c"])
@pytest.mark.parametrize("kind", ["Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q5_K"])
def test_short_scales_give_the_same_bits_as_fp32_ones_in_fewer_bytes(
    kind: str, build: str, avx2_build: Path, no_f16c_build: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Q4_0's, Q5_0's and Q8_0's scales are the file's fp16 d and their zeros -0.0: their panels hold fp16 scales and
    no zeros (F16_SCALES), widened exactly by every build (F16C, AVX-512's conversion, or plain C). Q4_K's panels
    hold its own factors (K_SCALES: fp16 d and dmin a super-block, 6-bit sc and m a block), from which every build
    computes each scale and zero as codes.py does, and so do Q5_K's (their zero 16 times the scale less dmin * m).
    Each output is the same bits as from fp32 scales and zeros, on calls of one row, of a tile, and through the
    buffer."""
    library = {"native": None, "avx2": avx2_build, "no-f16c": no_f16c_build}[build]
    five = kernel.takes_five(library or kernel.build(DIRECTORY))
    if kind == "Q5_K" and not five:
        pytest.skip("Q5_K's factors go with its 5-bit codes, which only an AVX-512 build takes")
    short, _ = block_layer(kind, (70, 512), library)
    monkeypatch.setattr(layouts, "half_scales", lambda codes: False)
    monkeypatch.setattr(layouts, "k_factors", lambda codes: False)
    full, _ = block_layer(kind, (70, 512), library)
    flag = layouts.K_SCALES if kind in ("Q4_K", "Q5_K") else layouts.F16_SCALES
    bits = layouts.FIVE if five and kind in ("Q5_0", "Q5_K") else short.bits  # in 5 bits where the build takes them
    assert (short.panel_bits, full.panel_bits) == (bits + flag, bits)
    assert short.arrays[2].numel() == 0
    held = [sum(a.numel() * a.element_size() for a in layer.arrays) for layer in (full, short)]
    # 5 panels of 16 outputs, 16 blocks: fp32 scales and zeros 128 bytes a block, fp16 scales 32; a K-quant's
    # factors 320 bytes a super-block of 8
    assert held[0] - held[1] == 5 * (16 * (128 - 32) if "K" not in kind else 16 * 128 - 2 * 320)
    x = torch.randn(24, 512)
    with torch.no_grad():
        for rows in (1, 3, 24):  # one row, a tile, the buffer
            assert torch.equal(short(x[:rows]), full(x[:rows])), rows


def test_only_fp16_scales_and_zeros_of_minus_zero_or_k_quant_factors_take_the_short_panels() -> None:
    for kind, short in (("Q4_0", True), ("Q5_0", True), ("Q8_0", True), ("Q4_1", False), ("Q5_1", False)):
        found = codes.decode(quantised((16, 64), kind)[0], int(KINDS[kind]), (16, 64))
        assert layouts.half_scales(found) is short, kind
        assert found.factors is None and not layouts.k_factors(found)
    for kind in ("Q4_K", "Q5_K", "Q6_K"):
        found = codes.decode(quantised((16, 256), kind)[0], int(KINDS[kind]), (16, 256))
        assert layouts.half_scales(found) is False, kind
        assert layouts.k_factors(found) is (kind in ("Q4_K", "Q5_K")), kind
    # Factors that do not give back the codes' zero (a changed zero) are not taken
    found = codes.decode(quantised((16, 256), "Q4_K")[0], int(KINDS["Q4_K"]), (16, 256))
    moved = codes.Codes(found.q, found.scale, found.zero + np.float32(1e-3), 4, found.factors)
    assert not layouts.k_factors(moved)
    # kept in the codes' cache, and through a reordering of the rows
    assert layouts.k_factors(found.rows(np.arange(16)[::-1].copy()))


@pytest.mark.parametrize("build", ["native", "avx2"])
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13])
def test_the_kernel_gives_the_fp32_product_of_the_files_weights(
    kind: str, rows: int, build: str, avx2_build: Path
) -> None:
    layer, dense = block_layer(kind, (38, 96), avx2_build if build == "avx2" else None)  # 38 outputs: 9 x 4 + 2
    x = torch.randn(rows, 96, dtype=torch.float64)
    with torch.no_grad():
        got = layer(x.float())
    want = x @ torch.from_numpy(dense).double().T  # in fp64: the kernel's own rounding is all that differs
    assert got.dtype == torch.float32 and got.shape == (rows, 38)
    assert float((got.double() - want).abs().max()) <= 1e-5 * float(want.abs().max())


@pytest.mark.parametrize("build", ["native", "avx2"])
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_the_kernels_weights_are_the_files_dequantised_weights_bit_for_bit(
    kind: str, build: str, avx2_build: Path
) -> None:
    """Rows of the identity read the weights back: fma(1, w, 0) is w, and fma(0, w, acc) leaves acc. In calls of
    4 rows (codes expanded in registers) and of all 96 (expanded into the buffer)."""
    layer, dense = block_layer(kind, (38, 96), avx2_build if build == "avx2" else None)
    eye = torch.eye(96)
    with torch.no_grad():
        tiles = torch.cat([layer(eye[i : i + 4]) for i in range(0, 96, 4)])
        whole = layer(eye)
    want = torch.from_numpy(dense).T  # gguf's own dequantisation, which transformers' loader uses
    assert torch.equal(tiles, want) and torch.equal(whole, want)


@pytest.mark.parametrize("build", ["native", "avx2"])
@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16", "F32"])
def test_the_kernel_runs_q5_k_quant_and_unquantised_weights_as_the_files_dequantised_weights(
    kind: str, build: str, avx2_build: Path
) -> None:
    """Their codes (or values, widened) read back by rows of the identity, bit for bit (in calls of 4 rows and of
    all 512), and their product with random rows to fp32's roundings of the fp64 product."""
    blocks, dense = quantised((38, 512), kind, sigma=0.02)
    layer = block_layer_from(
        blocks, kind, (38, 512), avx2_build if build == "avx2" else kernel.build(DIRECTORY), "fp32"
    )
    eye = torch.eye(512)
    x = torch.randn(5, 512, dtype=torch.float64)
    with torch.no_grad():
        tiles = torch.cat([layer(eye[i : i + 4]) for i in range(0, 512, 4)])
        whole = layer(eye)
        got = layer(x.float())
    want = torch.from_numpy(dense).T
    assert torch.equal(tiles, want) and torch.equal(whole, want)
    product = x @ torch.from_numpy(dense).double().T
    assert float((got.double() - product).abs().max()) <= 1e-5 * float(product.abs().max())


def test_an_avx2_build_without_f16c_widens_every_fp16_value_as_f16c_does(no_f16c_build: Path) -> None:
    """Every one of the 65,536 fp16 values, NaNs, infinities and subnormals included, read back by the identity:
    the same bits as this CPU's build (F16C, or AVX-512's conversion), and numpy's widening where a row is finite
    (fma(1, -0.0, +0.0) is +0.0; and 0 times an infinity in a row makes its every output NaN, on every build)."""
    every = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(np.float16).reshape(2048, 32)
    with torch.no_grad():
        back = [
            block_layer_from(every, "F16", (2048, 32), library, "fp32")(torch.eye(32)).T.numpy()
            for library in (no_f16c_build, kernel.build(DIRECTORY))
        ]
    assert np.array_equal(back[0].view(np.uint32), back[1].view(np.uint32))
    want = every.astype(np.float32) + np.float32(0)
    finite = np.isfinite(want).all(axis=1)
    assert finite.sum() == 2048 - 64  # the rows of exponent 31
    assert np.array_equal(back[0][finite].view(np.uint32), want[finite].view(np.uint32))


INT8_KINDS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
"""Every quantised type the kernel takes: fp16 tails (Q4_0, Q4_1, Q5_0, Q8_0), fp32 ones (Q5_1 and the K-quants),
and Q6_K's two scales a block."""


@pytest.mark.parametrize("kind", INT8_KINDS)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 13])
def test_int8_rows_give_the_product_of_the_weights_and_the_rows_quantised_per_block(kind: str, rows: int) -> None:
    layer, dense = block_layer(kind, (38, 256), activations="int8")  # 38 outputs: 2 panels and a padded one
    x = np.random.default_rng(rows).standard_normal((rows, 256)).astype(np.float32)
    x[0, :32] *= 50  # a block with an outlier gets its own, coarser steps
    x[-1, 32:64] = 0  # a block of zeros
    with torch.no_grad():
        got = layer(torch.from_numpy(x)).double().numpy()
    want = rows_as_int8(x) @ dense.astype(np.float64).T
    assert got.shape == (rows, 38)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()  # only the kernel's fp32 sums differ
    fp32 = x.astype(np.float64) @ dense.astype(np.float64).T
    assert np.abs(got - fp32).max() > 1e-4 * np.abs(fp32).max()  # the rows really were quantised


def exact_fma32(a: float, b: float, c: float) -> np.float32:
    """fma(a, b, c) in fp32: a * b + c exactly, rounded once to the nearest fp32 (halves to even)."""
    exact = Fraction(a) * Fraction(b) + Fraction(c)
    near = np.float32(float(exact))  # within one fp32 step of the exact value (rounded twice)
    candidates = [np.nextafter(near, np.float32(-np.inf)), near, np.nextafter(near, np.float32(np.inf))]
    return min(candidates, key=lambda v: (abs(Fraction(float(v)) - exact), int(v.view(np.uint32)) & 1))


def int8_rows_exactly(x: np.ndarray, blocks_of: codes.Codes) -> np.ndarray:
    """What int8_rows.c must give, bit for bit, on every build: the rows quantised in fp32 (steps d =
    max|x| / 127 of a block), the exact integer sums of codes times steps, then per block from zero, by the records'
    tail (layouts.records): fp16 scales and offsets, acc = fma(sum of unsigned codes, fp32(scale * d), acc) and
    acc = fma(offset, fp32(d * sum(steps)), acc); fp32 scales and zeros, the same with the codes' own q and zero;
    Q6_K's, acc = fma(sum of q, fp32(scale * d), acc) for its first 16 inputs, then its last 16."""
    rows, inputs = x.shape
    out = blocks_of.q.shape[0]
    steps, d = int8_steps(x)
    ds = d * steps.sum(-1).astype(np.float32)
    got = np.zeros((rows, out), np.float32)
    group = blocks_of.group
    if layouts.narrow(blocks_of):
        shift = 8 if blocks_of.bits == 4 else 128
        q = blocks_of.q.astype(np.int64) + shift
        scale = blocks_of.scale.astype(np.float16).astype(np.float32)
        zero = (blocks_of.zero - shift * blocks_of.scale).astype(np.float16).astype(np.float32)
    else:
        q, scale, zero = blocks_of.q.astype(np.int64), blocks_of.scale, blocks_of.zero
    steps = steps.reshape(rows, -1)
    for b in range(inputs // group):
        sums = steps[:, group * b : group * b + group] @ q[:, group * b : group * b + group].T  # exact integers
        block = b * group // 32
        for r in range(rows):
            for n in range(out):
                got[r, n] = exact_fma32(float(sums[r, n]), float(scale[n, b] * d[r, block]), float(got[r, n]))
                if group == 32:
                    got[r, n] = exact_fma32(float(zero[n, b]), float(ds[r, block]), float(got[r, n]))
    return got


@pytest.mark.parametrize("build", ["native", "avx2"])
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_int8_rows_are_the_same_bits_on_every_build(kind: str, build: str, avx2_build: Path) -> None:
    """The integer sums are exact on both builds (AVX-512 VNNI, and AVX2's 16-bit sums and signed 8-bit codes), and
    the fp32 operations after them are the same in the same order: the same bits as the exact reference, so as
    each other, for each records' tail. 38 outputs (a padded panel), 9 rows (uneven tiles), and blocks of outliers,
    zeros and halves."""
    blocks, _ = quantised((38, 256), kind)
    found = codes.decode(blocks, int(KINDS[kind]), (38, 256))
    layer, _ = block_layer(kind, (38, 256), avx2_build if build == "avx2" else None, "int8")
    want_bits = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8, "Q5_1": 8 + layouts.WIDE, "Q6_K": codes.SIXTEEN}
    assert layer.record_bits == want_bits.get(kind, found.bits + layouts.WIDE)
    x = np.random.default_rng(3).standard_normal((9, 256)).astype(np.float32)
    x[0, :32] *= 50
    x[-1, 32:64] = 0
    x[2, 64:96] = np.arange(-16, 16) / np.float32(2)  # steps of exactly k + 1/2 (127 / 8 a step): halves to even
    with torch.no_grad():
        got = layer(torch.from_numpy(x)).numpy()
    assert np.array_equal(got.view(np.uint32), int8_rows_exactly(x, found).view(np.uint32))


def test_a_layer_keeps_its_input_shape_and_adds_its_bias() -> None:
    layer, dense = block_layer("Q4_1", (40, 64))
    layer.bias = torch.nn.Parameter(torch.linspace(-1, 1, 40), requires_grad=False)
    x = torch.randn(2, 3, 64)  # [batch, tokens, features], as the model calls it
    with torch.no_grad():
        got = layer(x)
    want = torch.nn.functional.linear(x, torch.from_numpy(dense), layer.bias)
    assert got.shape == (2, 3, 40)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_strided_or_other_dtype_input_gives_what_its_contiguous_fp32_copy_gives_in_its_own_dtype() -> None:
    layer, _ = block_layer("Q4_1", (40, 64))
    x = torch.randn(64, 3)  # its transpose is not contiguous
    with torch.no_grad():
        want = layer(x.T.contiguous())
        strided = layer(x.T)
        double = layer(x.T.double())
    assert torch.equal(strided, want)
    assert double.dtype == torch.float64 and torch.equal(double, want.double())


@pytest.mark.parametrize(
    ("kind", "build"),
    [(kind, build) for kind in ("Q4_1", "Q8_0", "Q4_K", "Q6_K") for build in ("native", "avx2", "int8")]
    # the unquantised types have no int8 rows (Codes.unquantised)
    + [(kind, build) for kind in ("F16", "BF16", "F32") for build in ("native", "avx2")],
)
def test_each_row_is_the_same_bits_whatever_else_the_call_holds(kind: str, build: str, avx2_build: Path) -> None:
    activations = "int8" if build == "int8" else "fp32"
    inputs = 512 if kind in ("Q6_K", "Q4_K") else 576  # whole super-blocks
    layer, _ = block_layer(kind, (70, inputs), avx2_build if build == "avx2" else None, activations)
    x = torch.randn(20, inputs)
    with torch.no_grad():
        alone = torch.cat([layer(x[i : i + 1]) for i in range(20)])
        for count in range(2, 21):
            assert torch.equal(layer(x[:count]), alone[:count]), count
            assert torch.equal(layer(x[count - 2 : count]), alone[count - 2 : count]), count


@pytest.mark.parametrize("build", ["native", "no-vbmi", "avx2", "no-f16c"])
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_fp32_rows_are_the_kernels_arithmetic_on_the_codes_bit_for_bit_on_every_build_and_path(
    kind: str, build: str, avx2_build: Path, no_f16c_build: Path, no_vbmi_build: Path
) -> None:
    """Each output block by block: the block's inputs times its codes, then times its scale, then plus its zero
    times the block's sum of inputs (blocked_product), the same bits in calls of one row, of a tile (codes expanded
    in registers) and through the buffer (24 rows), with fp32 scales and zeros, fp16 scales (Q4_0, Q8_0) and Q4_K's
    factors, Q6_K's factor and bytes with 8-bit codes or 6-bit ones, on the AVX-512 (where the CPU has it; with and
    without VBMI), AVX2 and AVX2-without-F16C builds."""
    library = {"native": None, "no-vbmi": no_vbmi_build, "avx2": avx2_build, "no-f16c": no_f16c_build}[build]
    shape = (70, 512)  # 5 panels, the last of 6 real outputs; 16 blocks, 2 super-blocks
    blocks, _ = quantised(shape, kind, seed=7)
    layer = block_layer_from(blocks, kind, shape, library or kernel.build(DIRECTORY), "fp32")
    found = codes.decode(blocks, int(KINDS[kind]), shape)
    x = np.random.default_rng(11).standard_normal((24, 512)).astype(np.float32)
    x[3, 64:96] = 0.0  # a block of zeros, and one of large inputs
    x[4, 128:160] *= 1e4
    want = blocked_product(x, found)
    with torch.no_grad():
        for rows in (1, 3, 24):
            got = layer(torch.from_numpy(x[:rows])).numpy()
            assert np.array_equal(got.view(np.uint32), want[:rows].view(np.uint32)), rows


@pytest.fixture(scope="module")
def alone_and_shared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two copies of this CPU's build, each its own library (its own helpers): the second with a helper thread, to
    which each call leaves its last chunk for up to 1 s (ttft_helper_leave): the caller sleeps meanwhile, so the
    helper, at SCHED_IDLE, gets a core even when every core is busy (a CI machine running other work)."""
    alone, shared = (
        builds.copy_of(kernel.build(DIRECTORY), tmp_path_factory.mktemp(name)) for name in ("alone", "shared")
    )
    assert kernel.start_helpers(shared, 1) == 1
    compiler.load(shared, "ttft_helper_leave", (ctypes.c_int64,))(1_000_000)
    return alone, shared


@pytest.fixture
def helpers_pause(alone_and_shared: tuple[Path, Path]) -> Any:
    """Sets how long the shared build's helpers sleep in every chunk they hold (µs); back to 0 after the test."""
    pause = compiler.load(alone_and_shared[1], "ttft_helper_pause", (ctypes.c_int64,))
    yield pause
    pause(0)


def helped(library: Path, call: Any, *, until: Any) -> kernel.HelperCounts:
    """Makes ``call`` again (at most 400 times) until the library's helper counts satisfy ``until``; returns them.
    The helper takes each call's last chunk when it gets a core within the second the caller leaves it
    (alone_and_shared): the first call, unless the machine is starved for a whole second."""
    for _ in range(400):
        call()
        counts = kernel.helper_counts(library)
        if until(counts):
            return counts
    raise AssertionError(f"the helper thread did not take part in 400 calls: {counts}")


@pytest.mark.parametrize(
    ("kind", "activations"),
    [("Q4_1", "fp32"), ("Q4_1", "int8"), ("Q8_0", "fp32"), ("Q8_0", "int8"), ("Q6_K", "fp32"), ("F16", "fp32")],
)
@pytest.mark.parametrize("rows", [1, 4, 5, 8, 37])
def test_a_call_shared_with_a_helper_thread_gives_the_same_bits_as_alone(
    kind: str, rows: int, activations: str, alone_and_shared: tuple[Path, Path]
) -> None:
    alone, shared = alone_and_shared
    seed = rows * 10 + (activations == "int8")
    inputs = 512 if kind in ("Q6_K", "Q4_K") else 576  # whole super-blocks
    blocks, _ = quantised((1000, inputs), kind, seed=seed)  # 63 panels, the last 8 outputs of 16 real
    layers = [block_layer_from(blocks, kind, (1000, inputs), library, activations) for library in (alone, shared)]
    x = torch.from_numpy(np.random.default_rng(seed).standard_normal((rows, inputs)).astype(np.float32))
    with torch.no_grad():
        want = layers[0](x)
        before = kernel.helper_counts(shared).by_helpers
        got: list[Any] = []

        def call() -> None:
            got.append(layers[1](x))

        helped(shared, call, until=lambda counts: counts.by_helpers > before)
    assert all(torch.equal(y, want) for y in got)


def test_a_chunk_the_helper_holds_too_long_is_taken_back_with_the_same_bits(
    alone_and_shared: tuple[Path, Path], helpers_pause: Any
) -> None:
    alone, shared = alone_and_shared
    blocks, _ = quantised((1536, 576), "Q4_1", seed=3)
    layers = [block_layer_from(blocks, "Q4_1", (1536, 576), library, "fp32") for library in (alone, shared)]
    x = torch.randn(8, 576)
    helpers_pause(100_000)  # 0.1 s in each chunk it holds: the caller's patience is twice its own time a chunk
    with torch.no_grad():
        want = layers[0](x)
        before = kernel.helper_counts(shared).taken_back
        got: list[Any] = []
        counts = helped(shared, lambda: got.append(layers[1](x)), until=lambda counts: counts.taken_back > before)
    assert all(torch.equal(y, want) for y in got)
    assert counts.helpers == 1


_PTR = ctypes.c_void_p


@pytest.fixture(scope="module")
def attention_library() -> Path:
    """engine/kernels/attention.c built for this CPU (the engine's build)."""
    return attention.build(DIRECTORY)


class AttentionStep:
    """A batched step's attention for the bundled model's heads (9 query heads on 3 KV heads of 64): ``requests``
    of (new rows, keys) over a KV cache whose rows the step's index reads scattered; computed alone by attention.c
    or shared with the helper threads of the kernel's library ``shared``; with ``half``, a cache of fp16 values
    (TTFT_KV_DTYPE=f16), by attention.c's functions for them."""

    def __init__(
        self, requests: list[tuple[int, int]], library: Path, shared: Path, seed: int, half: bool = False
    ) -> None:
        rng = np.random.default_rng(seed)
        self.heads, self.kv_heads, self.dim = 9, 3, 64
        rows, keys = sum(n for n, _ in requests), sum(k for _, k in requests)
        slots = 2 * keys
        self.q = rng.standard_normal((rows, self.heads * self.dim)).astype(np.float32)
        kv_type = np.float16 if half else np.float32
        self.k, self.v = (rng.standard_normal((slots, self.kv_heads * self.dim)).astype(kv_type) for _ in "kv")
        self.index = rng.permutation(slots)[:keys].astype(np.int64)
        self.cu_q = np.cumsum([0, *(n for n, _ in requests)]).astype(np.int32)
        self.cu_k = np.cumsum([0, *(k for _, k in requests)]).astype(np.int32)
        self.requests = len(requests)
        alone, part = (attention.PAGED_HALF, attention.PAGED_PART_HALF) if half else (None, "ttft_attention_part")
        self.alone = compiler.load(library, alone, attention.ARGUMENTS) if alone else attention.function(library)
        self.part = ctypes.cast(compiler.load(library, part, ()), _PTR).value
        # ttft_share_attention (helpers.c): attention.c's part function, then ttft_paged_attention's arguments.
        self.share = compiler.load(shared, "ttft_share_attention", (_PTR, *attention.ARGUMENTS))

    def _arguments(self, out: npt.NDArray[np.float32]) -> tuple[Any, ...]:
        def at(a: npt.NDArray[Any]) -> int:
            return int(a.ctypes.data)

        return (
            at(self.q), self.heads, self.kv_heads, self.dim, at(self.k), at(self.v), self.kv_heads * self.dim,
            self.dim, at(self.index), at(self.cu_q), at(self.cu_k), self.requests, 512, 0.125, at(out),
        )  # fmt: skip

    def computed_alone(self) -> npt.NDArray[np.float32]:
        out = np.full_like(self.q, np.nan)
        assert self.alone(*self._arguments(out)) == 0
        return out

    def computed_shared(self) -> tuple[int, npt.NDArray[np.float32]]:
        """ttft_share_attention's status (0: shared, 1: computed alone, by the caller's fallback) and output."""
        out = np.full_like(self.q, np.nan)
        status = self.share(self.part, *self._arguments(out))
        if status == 1:
            assert self.alone(*self._arguments(out)) == 0
        return status, out


STEPS = {
    "decode-8x200": [(1, 200)] * 8,  # a decode step of 8 streams
    "decode-1x1000": [(1, 1000)],  # one stream's decode step: one row, shared by its KV heads
    "prefill-mix": [(37, 37), (1, 300), (15, 50), (1, 9)],  # new prompts, one behind a known prefix, and decodes
    "behind-a-long-prefix": [(30, 1150), (1, 40)],  # a chunk a part, made whole pairs of rows (helpers.c)
}


@pytest.mark.parametrize("half", [False, True], ids=["fp32-cache", "f16-cache"])
@pytest.mark.parametrize("step", STEPS)
def test_a_steps_attention_shared_with_a_helper_thread_gives_the_same_bits_as_alone(
    step: str, half: bool, alone_and_shared: tuple[Path, Path], attention_library: Path
) -> None:
    shared = alone_and_shared[1]
    attend = AttentionStep(STEPS[step], attention_library, shared, seed=len(step), half=half)
    want = attend.computed_alone()
    assert not np.isnan(want).any()
    before = kernel.helper_counts(shared)
    got: list[tuple[int, npt.NDArray[np.float32]]] = []
    try:
        helped(shared, lambda: got.append(attend.computed_shared()), until=lambda c: c.by_helpers > before.by_helpers)
    finally:
        kernel.fence(shared)  # a helper may still read attend's arrays (a chunk taken back from it)
    assert [status for status, _ in got].count(0) >= 1  # shared at least once: the helper computed chunks of it
    assert all(np.array_equal(out, want) for _, out in got)


def test_an_attention_chunk_the_helper_holds_too_long_is_taken_back_and_the_next_call_runs_alone(
    alone_and_shared: tuple[Path, Path], helpers_pause: Any, attention_library: Path
) -> None:
    # While a helper is still inside a chunk taken back from it, it may read the step's key index: the next
    # attention call must not rewrite the share's copy of it, so it runs alone (helpers.c's share_run).
    shared = alone_and_shared[1]
    attend = AttentionStep(STEPS["decode-8x200"], attention_library, shared, seed=7)
    want = attend.computed_alone()
    helpers_pause(2_000_000)  # 2 s in each chunk it holds: a stall of this thread cannot outlast it
    before = kernel.helper_counts(shared).taken_back
    got: list[tuple[int, npt.NDArray[np.float32]]] = []
    try:
        helped(shared, lambda: got.append(attend.computed_shared()), until=lambda c: c.taken_back > before)
        calls = kernel.helper_counts(shared).calls
        status, right_after = attend.computed_shared()  # well within the helper's 2 s
    finally:
        helpers_pause(0)
        kernel.fence(shared)  # the helper may still read attend's arrays
    assert (status, kernel.helper_counts(shared).calls) == (1, calls)
    assert all(np.array_equal(out, want) for _, out in [*got, (status, right_after)])


def tiny_model(tmp_path: Path, *, tied: bool = False) -> tuple[Any, Any]:
    """The layers of tests/engine/kernels/test_codes.py (stored as Q4_1, Q8_0 and F32) as a model, and the file's
    tensors for them; with ``tied``, an embedding sharing the Q8_0 layer's weight, as a tied LM head does."""
    layers, path = layers_of(tmp_path)
    model = torch.nn.Sequential(*layers.values())
    if tied:
        model.append(torch.nn.Embedding(32, 96))
        model[3].weight = model[1].weight
    return model, sequential(path, reversed_rows=("up",))


@pytest.mark.parametrize(("activations", "least", "most"), [("fp32", 0.0, 1e-5), ("int8", 1e-5, 0.05)])
def test_apply_puts_exactly_the_layers_the_file_holds_as_blocks_on_the_kernel(
    tmp_path: Path, activations: str, least: float, most: float
) -> None:
    if activations == "int8":
        skip_without_int8()
    model, stored = tiny_model(tmp_path)
    x = torch.randn(3, 64)
    with torch.no_grad():
        want = model(x)
    with capture_logs() as logs:
        applied = kernel.apply(model, stored, torch, directory=DIRECTORY, activations=activations)
    rows = "blocks: 1" if activations == "fp32" else "blocks, int8 rows: 1"
    dense = "blocks: 1" if activations == "fp32" else "blocks, fp32 rows: 1 (not quantised: int8 rows multiply"
    by_type = {"F32": dense if activations == "fp32" else f"{dense} quantised blocks)", "Q4_1": rows, "Q8_0": rows}
    assert applied == (activations, by_type)
    blocks = {"event": "weights_blocks", "log_level": "info", "layers": 3, "q4": 1, "q8": 1, "q5": 0, "q6": 0}
    blocks["dense"] = 1
    assert {**blocks, "activations": activations, "by_type": by_type} in logs
    assert [type(layer).__name__ for layer in model] == ["BlockLinear"] * 3
    assert [layer.activations for layer in model] == [activations, activations, "fp32"]  # F32: dense, fp32 rows
    assert [layer.weight.numel() for layer in model] == [0, 0, 0]  # fp32 weights on the kernel are dropped
    with torch.no_grad():
        got = model(x)
    # Against the largest value (an output near zero after sums of values near 1e3 keeps their rounding). Int8
    # rows add their steps' error: more than fp32 sums, far less than the values.
    error = float((got - want).abs().max() / want.abs().max())
    assert least <= error <= most, error


def test_on_a_cpu_without_avx512_vnni_or_f16c_int8_rows_fall_back_to_fp32_and_the_log_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, stored = tiny_model(tmp_path)
    with builds.flags("-mno-avx512vnni", "-mno-f16c"), capture_logs() as logs:
        got = kernel.apply(model, stored, torch, directory=DIRECTORY, activations="int8")
    assert got.activations == "fp32"
    logs = [entry for entry in logs if entry["event"] != "kernel_built"]  # built here, or by a run before
    assert [entry["event"] for entry in logs] == ["activations_not_int8", "weights_blocks"]
    assert logs[0] == {
        "event": "activations_not_int8",
        "log_level": "warning",
        "reason": "the CPU has neither AVX-512 VNNI nor AVX2 with F16C: the rows stay fp32",
    }
    assert [layer.activations for layer in model] == ["fp32", "fp32", "fp32"]


def test_a_weight_another_module_shares_is_kept(tmp_path: Path) -> None:
    model, stored = tiny_model(tmp_path, tied=True)
    with capture_logs():
        assert kernel.apply(model, stored, torch, directory=DIRECTORY).activations == "fp32"
    assert type(model[1]).__name__ == "BlockLinear"
    assert model[1].weight is model[3].weight and model[3].weight.shape == (32, 96)  # the embedding still reads it
    assert model[0].weight.numel() == 0


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fma(a, b, c) in fp32, element by element: a * b + c exactly, rounded once to the nearest fp32 (halves to
    even). In fp64 a * b is exact and a * b + c is s plus an exact error e (Knuth's two-sum): s rounded to fp32 is
    the exact sum's rounding unless s lies halfway between two fp32 values, where e's sign decides."""
    product, addend = a.astype(np.float64) * b.astype(np.float64), c.astype(np.float64)
    s = product + addend
    back = s - product
    e = (product - (s - back)) + (addend - back)
    r = s.astype(np.float32)
    other = np.where(s > r, np.nextafter(r, np.float32(np.inf)), np.nextafter(r, np.float32(-np.inf)))
    halfway = (r != s) & (s - r.astype(np.float64) == other.astype(np.float64) - s)
    beyond = np.sign(e) == np.sign(other.astype(np.float64) - s)  # the exact sum lies past s, towards other
    return np.where(halfway & (e != 0), np.where(beyond, other, r), r)


def kernel_product(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """What the block kernel computes for rows ``x`` and a dense layer's fp32 weights ``weight`` (outputs x inputs),
    bit for bit: each output one chain of fused multiply-adds in input order, from zero (kernel.c)."""
    acc = np.zeros((x.shape[0], weight.shape[0]), np.float32)
    for k in range(x.shape[1]):
        acc = fma32(x[:, k : k + 1], weight[None, :, k], acc)
    return acc


def block_sums(x: np.ndarray) -> np.ndarray:
    """Each block of 32 inputs' sum, as kernel.c's fp32_sums adds them: each half's 16 as a tree (8 pairs 8 apart,
    then 4 apart, 2, 1), then the two halves, in fp32."""
    t = x.astype(np.float32).reshape(x.shape[0], -1, 2, 16)
    for width in (8, 4, 2, 1):
        t = t[..., :width] + t[..., width : 2 * width]
    return t[..., 0, 0] + t[..., 1, 0]


def blocked_product(x: np.ndarray, found: codes.Codes) -> np.ndarray:
    """What the block kernel computes for rows ``x`` and a layer's codes, bit for bit (kernel.c): each output block
    by block, the chain of fused multiply-adds of the block's inputs times its codes from zero (part), then
    acc = fma(scale, part, acc) and, where the blocks have zeros (not all -0.0), acc = fma(block sum, zero, acc)."""
    q, group = found.q.astype(np.float32), found.group
    zeros = not bool(np.all((found.zero == 0) & np.signbit(found.zero)))
    sums = block_sums(x) if zeros else None
    acc = np.zeros((x.shape[0], q.shape[0]), np.float32)
    for b in range(q.shape[1] // group):
        part = np.zeros_like(acc)
        for k in range(b * group, (b + 1) * group):
            part = fma32(x[:, k : k + 1], q[None, :, k], part)
        acc = fma32(found.scale[None, :, b], part, acc)
        if sums is not None:
            acc = fma32(sums[:, b : b + 1], found.zero[None, :, b], acc)
    return acc


K_MODEL = [  # name, GGUF type, inputs, outputs: a chain of 64 -> 256 -> 256 -> 256 -> 96 -> 48 features
    ("q5_0", "Q5_0", 64, 256),
    ("q4_k", "Q4_K", 256, 256),
    ("q6_k", "Q6_K", 256, 256),
    ("q5_k", "Q5_K", 256, 96),
    ("q5_1", "Q5_1", 96, 48),
]


def k_quant_model(tmp_path: Path) -> tuple[Any, Any]:
    """Linear layers stored as Q5_0, Q4_K, Q6_K, Q5_K and Q5_1 in a file, holding gguf's dequantisation of them, as
    a model (the Q4_K rows reordered, as transformers' loader does to q and k)."""
    path = tmp_path / "k-quants.gguf"
    model = torch.nn.Sequential()
    tensors = {}
    for seed, (name, kind, inputs, outputs) in enumerate(K_MODEL):
        blocks, dense = quantised((outputs, inputs), kind, seed=seed, sigma=0.5 / inputs**0.5)
        tensors[name] = (blocks, kind)
        layer = torch.nn.Linear(inputs, outputs, bias=False)
        with torch.no_grad():
            layer.weight.copy_(torch.from_numpy(dense[::-1].copy() if kind == "Q4_K" else dense))
        model.append(layer)
    write_gguf(path, tensors)
    return model, sequential(path, reversed_rows=("q4_k",))


def test_a_model_of_q5_and_k_quant_layers_runs_on_the_kernel_with_the_fp32_layers_outputs(tmp_path: Path) -> None:
    model, stored = k_quant_model(tmp_path)
    weights = [layer.weight.detach().numpy().copy() for layer in model]
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32))
    with torch.no_grad():
        before = model(x)
    with capture_logs() as logs:
        applied = kernel.apply(model, stored, torch, directory=DIRECTORY, cache=tmp_path)
    by_type = {
        "Q4_K": "blocks: 1",
        "Q5_0": "blocks: 1",
        "Q5_1": "blocks: 1",
        "Q5_K": "blocks: 1",
        "Q6_K": "blocks: 1",
    }
    assert applied == ("fp32", by_type)
    # the Q5 types' codes in 5 bits (q5) where the build takes them, else in 8 (q8)
    q5 = 3 if kernel.takes_five(kernel.build(DIRECTORY)) else 0
    blocks = {"event": "weights_blocks", "log_level": "info", "layers": 5, "q4": 1, "q8": 3 - q5, "q5": q5, "q6": 1}
    blocks["dense"] = 0
    kept = {"event": "arrangement_kept", "log_level": "info", "path": str(tmp_path / "kernel-arrays-fp32.bin")}
    mib = 0.1 if kernel.takes_six(kernel.build(DIRECTORY)) else 0.2  # Q6_K's codes in 6 bits, or in 8
    assert logs == [{**kept, "layers": 5, "mib": mib}, {**blocks, "activations": "fp32", "by_type": by_type}]
    assert [type(layer).__name__ for layer in model] == ["BlockLinear"] * 5
    assert [layer.bits for layer in model] == [8, 4, codes.SIXTEEN, 8, 8]
    with torch.no_grad():
        got = model(x)
        # Each layer on the kernel holds the loaded weight, bit for bit: rows of the identity read it back.
        for layer, weight in zip(model, weights, strict=True):
            assert torch.equal(layer(torch.eye(layer.in_features)), torch.from_numpy(weight).T)
    # The outputs of the kernel's arithmetic on the file's codes, exactly.
    h = x.numpy()
    for seed, (_, kind, inputs, outputs) in enumerate(K_MODEL):  # the file's blocks, as k_quant_model made them
        blocks, _ = quantised((outputs, inputs), kind, seed=seed, sigma=0.5 / inputs**0.5)
        found = codes.decode(blocks, int(KINDS[kind]), (outputs, inputs))
        h = blocked_product(h, found.rows(np.arange(outputs)[::-1].copy()) if kind == "Q4_K" else found)
    assert np.array_equal(got.numpy().view(np.uint32), h.view(np.uint32))
    # And in torch's order of sums, the same to fp32's roundings.
    assert float((got - before).abs().max()) <= 1e-5 * float(before.abs().max())


def test_with_int8_rows_every_quantised_type_takes_them_in_the_records_that_hold_its_scales(tmp_path: Path) -> None:
    """Q5_0's scale d and offset -128d are the file's fp16 values: fp16 tails. A K-quant's d*sc is not an fp16
    value, nor is Q5_1's offset m - 112d: fp32 tails; Q6_K's scales cover 16 inputs: two a block. Each layer gives
    the product of its weight and the quantised rows."""
    skip_without_int8()
    model, stored = k_quant_model(tmp_path)
    weights = [layer.weight.detach().numpy().astype(np.float64) for layer in model]
    with capture_logs() as logs:
        applied = kernel.apply(model, stored, torch, directory=DIRECTORY, activations="int8")
    assert applied == ("int8", dict.fromkeys(["Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K"], "blocks, int8 rows: 1"))
    assert [entry["event"] for entry in logs] == ["weights_blocks"]
    assert [layer.activations for layer in model] == ["int8"] * 5
    wide = layouts.WIDE
    assert [layer.record_bits for layer in model] == [8, 4 + wide, codes.SIXTEEN, 8 + wide, 8 + wide]
    for seed, (layer, weight) in enumerate(zip(model, weights, strict=True)):
        x = np.random.default_rng(seed).standard_normal((3, layer.in_features)).astype(np.float32)
        with torch.no_grad():
            got = layer(torch.from_numpy(x)).double().numpy()
        want = rows_as_int8(x) @ weight.T
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_with_int8_rows_an_unquantised_layer_keeps_fp32_rows_and_the_account_says_why(tmp_path: Path) -> None:
    skip_without_int8()
    path = tmp_path / "mixed.gguf"
    blocks, dense = quantised((32, 256), "Q4_K")
    values = np.random.default_rng(1).standard_normal((32, 256)).astype(np.float16)
    write_gguf(path, {"k": (blocks, "Q4_K"), "f": (values, "F16")})
    stored = sequential(path)
    model = torch.nn.Sequential(torch.nn.Linear(256, 32, bias=False), torch.nn.Linear(256, 32, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(torch.from_numpy(dense))
        model[1].weight.copy_(torch.from_numpy(values.astype(np.float32)))
    applied = kernel.apply(model, stored, torch, directory=DIRECTORY, activations="int8")
    why = "blocks, fp32 rows: 1 (not quantised: int8 rows multiply quantised blocks)"
    assert applied == ("int8", {"F16": why, "Q4_K": "blocks, int8 rows: 1"})
    assert [layer.activations for layer in model] == ["int8", "fp32"]


def test_degrade_holds_int8_records_for_a_model_of_k_quants_and_switches_to_them(tmp_path: Path) -> None:
    """TTFT_DEGRADE=int8 needs every quantised layer in int8 records too: the K-quants', Q5_1's and Q6_K's take fp32
    tails, so the int8 mode exists for such a model; a thread in it gets the int8 rows' product."""
    skip_without_int8()
    model, stored = k_quant_model(tmp_path)
    weight = model[1].weight.detach().numpy().astype(np.float64)  # Q4_K's
    applied = kernel.apply(model, stored, torch, directory=DIRECTORY, degrade=True)
    assert applied.activations == "fp32"
    assert all(layer.records is not None for layer in model)
    layer = model[1]  # Q4_K
    x = torch.from_numpy(np.random.default_rng(2).standard_normal((2, layer.in_features)).astype(np.float32))
    with torch.no_grad():
        fp32 = layer(x)
        with kernel.int8_rows():
            int8 = layer(x)
        again = layer(x)
        want = rows_as_int8(x.numpy()) @ weight.T
    assert torch.equal(fp32, again)
    assert not torch.equal(fp32, int8)
    assert np.abs(int8.double().numpy() - want).max() <= 1e-5 * np.abs(want).max()
    with pytest.raises(ValueError, match="int8 records hold quantised codes"):
        records(codes.decode(np.ones((16, 32), np.float16).view(np.uint8), codes.F16, (16, 32)))


def test_a_model_with_no_layer_in_a_type_the_kernel_runs_is_left_as_it_was_and_the_log_names_its_types(
    tmp_path: Path,
) -> None:
    path = tmp_path / "q2_k.gguf"
    blocks = np.random.default_rng(0).integers(0, 256, (32, 84), dtype=np.uint8)  # one Q2_K super-block a row
    blocks[:, 80:84] = np.array([0.01, 0.005], np.float16).view(np.uint8)  # its d and dmin: finite
    write_gguf(path, {"only": (blocks, "Q2_K")})
    stored = sequential(path)
    model = torch.nn.Sequential(torch.nn.Linear(256, 32, bias=False))
    with torch.no_grad():
        weight = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q2_K)
        model[0].weight.copy_(torch.from_numpy(weight.astype(np.float32)))
    with capture_logs() as logs:
        applied = kernel.apply(model, stored, torch, directory=DIRECTORY)
    by_type = {"Q2_K": "fp32: 1 (no kernel layout for 16-input scales and minimums)"}
    assert applied == (None, by_type)
    reason = "no linear weight of the model is stored in a type the kernel runs"
    assert logs == [{"event": "weights_not_blocks", "log_level": "warning", "reason": reason, "by_type": by_type}]
    assert type(model[0]) is torch.nn.Linear


def test_a_model_of_f16_bf16_and_f32_layers_runs_on_the_kernel_with_the_fp32_layers_outputs(tmp_path: Path) -> None:
    """An unquantised GGUF's layers on the kernel's dense layouts, the LM head's F16 too: the loaded weights bit
    for bit, and the fp32 layers' outputs in the kernel's order of sums, exactly; int8 rows are not theirs."""
    path = tmp_path / "dense.gguf"
    model, tensors = torch.nn.Sequential(), {}
    for seed, (kind, inputs, outputs) in enumerate([("F16", 64, 96), ("BF16", 96, 64), ("F32", 64, 40)]):
        blocks, dense = quantised((outputs, inputs), kind, seed=seed, sigma=0.5 / inputs**0.5)
        tensors[kind.lower()] = (blocks, kind)
        model.append(torch.nn.Linear(inputs, outputs, bias=False))
        with torch.no_grad():
            model[-1].weight.copy_(torch.from_numpy(dense))
    write_gguf(path, tensors)
    stored = sequential(path)
    weights = [layer.weight.detach().numpy().copy() for layer in model]
    with capture_logs() as logs:
        applied = kernel.apply(model, stored, torch, directory=DIRECTORY)
    assert applied == ("fp32", {"BF16": "blocks: 1", "F16": "blocks: 1", "F32": "blocks: 1"})
    assert {"layers": 3, "q4": 0, "q8": 0, "q6": 0, "dense": 3}.items() <= logs[-1].items()
    assert [layer.bits for layer in model] == [codes.HALF, codes.BRAIN, codes.FULL]
    x = np.random.default_rng(5).standard_normal((3, 64)).astype(np.float32)
    with torch.no_grad():
        got = model(torch.from_numpy(x)).numpy()
        for layer, weight in zip(model, weights, strict=True):
            assert torch.equal(layer(torch.eye(layer.in_features)), torch.from_numpy(weight).T)
    h = x
    for weight in weights:
        h = kernel_product(h, weight)
    assert np.array_equal(got.view(np.uint32), h.view(np.uint32))


def wrong_zeros(monkeypatch: pytest.MonkeyPatch) -> None:
    real = kernel.function(kernel.build(DIRECTORY))
    wrong = lambda x, m, k, c, bits, scale, zero, n, y: real(x, m, k, c, bits, scale, scale, n, y)  # noqa: E731
    monkeypatch.setattr(kernel, "function", lambda _path, _name: wrong)  # the scales taken for the zeros


def no_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiler.shutil, "which", lambda _name: None)
    monkeypatch.setattr(compiler.Path, "is_file", lambda _path: False)  # not even a build from an earlier run


def four_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)


@pytest.mark.parametrize(
    ("cause", "reason"),
    [
        (wrong_zeros, "the block kernel disagrees with its fp64 reference at 1 rows"),
        (no_compiler, "the kernel was not built: no C compiler (cc or gcc) on PATH"),
        (four_threads, "the block kernel runs on one thread; torch has 4"),
    ],
    ids=["kernel-disagrees", "no-compiler", "four-threads"],
)
def test_where_the_kernel_cannot_serve_every_layer_stays_as_it_was_and_the_log_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cause: Any, reason: str
) -> None:
    model, stored = tiny_model(tmp_path)
    cause(monkeypatch)
    with capture_logs() as logs:
        assert kernel.apply(model, stored, torch, directory=DIRECTORY) == (None, {})
    assert [type(layer) for layer in model] == [torch.nn.Linear] * 3
    assert not hasattr(model[0], "arrays") and model[0].weight.shape == (96, 64)
    assert logs == [{"event": "weights_not_blocks", "log_level": "warning", "reason": reason}]


async def test_the_bundled_model_runs_every_linear_layer_on_the_kernel(settings: Settings) -> None:
    """The decoders' layers (Q4_1) and the LM head (Q8_0, tied to the embedding) all take the kernel, and the
    embedding reads its rows from the file: no fp32 copy of the table is left; the answer is right and each decode
    step goes through the kernel."""
    engine = BatchedEngine(settings)
    with capture_logs() as logs:
        engine.load(StageClock())
    try:
        model = engine.model
        on_kernel = [m for m in model.modules() if isinstance(m, kernel.block_linear_class())]
        assert len(on_kernel) == 7 * model.config.num_hidden_layers + 1  # q, k, v, o, gate, up, down; LM head
        assert model.lm_head.bits == 8 and model.lm_head.weight.numel() == 0
        embedding = model.get_input_embeddings()
        assert type(embedding).__name__ == "FileRowsEmbedding" and embedding.weight.numel() == 0
        assert engine.info.weights == "gguf-blocks"
        by_type = {"Q4_1": "blocks: 210", "Q8_0": "blocks: 1"}
        assert engine.info.weights_by_type == by_type
        blocks = {
            "event": "weights_blocks",
            "log_level": "info",
            "layers": len(on_kernel),
            "q4": 210,
            "q8": 1,
            "q5": 0,
            "q6": 0,
            "dense": 0,
        }
        assert {**blocks, "activations": "fp32", "by_type": by_type} in logs
        rows: list[int] = []
        head: list[int] = []
        first = model.model.layers[0]  # its linear layers run inside it, in C (engine/library/decoder.py)
        hooks = [
            first.register_forward_hook(lambda _m, args, _out: rows.append(args[0].numel() // 576)),
            model.lm_head.register_forward_hook(lambda _m, args, _out: head.append(args[0].numel() // 576)),
        ]
        text, finished = await collect(
            engine.stream(prompt_of(engine, "What is the capital of France?"), SamplingParams(max_tokens=12))
        )
        for hook in hooks:
            hook.remove()
    finally:
        await engine.close()
    assert text == "The capital of France is Paris.", text
    steps = finished.usage.completion_tokens
    assert rows.count(1) == steps - 1 and len(rows) == steps  # the prompt's step, then one row a decode step
    assert head == [1] * steps  # the LM head sees the last position of each step only


def test_with_int8_rows_the_bundled_model_predicts_nearly_what_it_predicts_in_fp32(settings: Settings) -> None:
    """Int8 rows change the answers (and make them depend on the batch, as bf16 does), not what the model knows:
    teacher-forced on a passage, the next-token choice agrees with fp32 rows' at nearly every position."""
    skip_without_int8()
    logits = {}
    for activations in ("fp32", "int8"):
        engine = SingleEngine(settings.replace(gguf_activations=activations))
        with capture_logs():
            engine.load(StageClock())
        suffix = "-int8" if activations == "int8" else ""
        assert engine.info.weights == f"gguf-blocks{suffix}"
        ids = engine.tokenizer(PASSAGE, return_tensors="pt").input_ids
        with torch.inference_mode():
            logits[activations] = engine.model(ids).logits[0].double()
    fp32, int8 = logits["fp32"], logits["int8"]
    agreement = float((fp32.argmax(-1) == int8.argmax(-1)).double().mean())
    p, q = fp32.log_softmax(-1), int8.log_softmax(-1)
    divergence = float((p.exp() * (p - q)).sum(-1).mean())
    assert agreement >= 0.9 and divergence <= 0.01, (agreement, divergence)
    assert not torch.equal(fp32, int8)  # the rows really were quantised


def test_the_probe_compares_every_output_of_a_small_layer_and_of_a_large_one_each_panel_offset_and_the_last_panel() -> (
    None
):
    assert layouts.probed_outputs(96, torch).tolist() == list(range(96))
    outputs = 49152  # the bundled model's LM head
    probed = layouts.probed_outputs(outputs, torch)
    assert len(probed) <= layouts.PROBED_OUTPUTS
    assert set(range(outputs - kernel.PANEL, outputs)) <= set(probed.tolist())
    assert {int(i) % kernel.PANEL for i in probed} == set(range(kernel.PANEL))
    assert int(probed[1] - probed[0]) * layouts.PROBED_OUTPUTS >= outputs - kernel.PANEL  # spread over every panel
