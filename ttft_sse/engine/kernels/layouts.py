"""A weight's codes in the block kernel's layouts (kernel.c, int8_rows.c): panels of 16 outputs for fp32 rows,
records for int8 rows, with fp16 tails where the file's values allow and fp32 ones elsewhere."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from ttft_sse.engine.kernels import codes as gguf_codes

PANEL = 16
"""Outputs a panel of kernel.c's layout."""


def panels(
    codes: gguf_codes.Codes, six: bool = False, five: bool = False
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[Any], npt.NDArray[np.float32]]:
    """``codes`` in kernel.c's layout: panels of :data:`PANEL` outputs (the last one padded with zero weights), the
    codes of each input's 16 outputs side by side (4-bit ones two inputs a byte, plus 8; with ``five``, a kernel
    built with AVX-512: kernel.takes_five, 8-bit ones of -16..15, as the Q5 types' are, in 5 bits:
    :func:`five_codes`), and a block's 16 scales and zeros likewise (fp16 scales and empty zeros where
    :func:`half_scales`; a K-quant's factors where :func:`k_factors`, with 4-bit or 5-bit codes). Q6_K's codes
    (:data:`~ttft_sse.engine.kernels.codes.SIXTEEN`) have a scale each 16 inputs and no zeros: their zeros are empty
    (panels x 0 x 16); where :func:`six_factors` finds each super-block's factor and each block's signed byte, their
    scales are :func:`six_records` instead of fp32 ones, and with ``six`` (a kernel built with AVX-512 VBMI:
    kernel.takes_six) their codes :func:`six_codes`. A dense type's values (codes.DENSE_DTYPES) lie likewise, each
    input's 16 side by side, as their bytes, with empty scales and zeros."""
    out, inputs = codes.q.shape
    padded = _padded(out)
    if codes.unquantised:
        values = np.zeros((padded, inputs), codes.q.dtype)
        values[:out] = codes.q
        laid = np.ascontiguousarray(values.reshape(padded // PANEL, PANEL, inputs).transpose(0, 2, 1))
        empty = np.zeros((padded // PANEL, 0, PANEL), np.float32)
        return laid.view(np.uint8), empty, empty.copy()
    no_zeros = np.zeros((padded // PANEL, 0, PANEL), np.float32)  # zeros kernel.c adds without reading
    factors = six_factors(codes) if codes.bits == gguf_codes.SIXTEEN else None
    if factors is not None and six:  # SIX_PACKED
        return six_codes(codes), six_records(*factors), no_zeros
    q = np.zeros((padded, inputs), np.int8)
    q[:out] = codes.q
    by_input = q.reshape(padded // PANEL, PANEL, inputs).transpose(0, 2, 1)  # panels x inputs x 16
    packed: npt.NDArray[Any]
    in_five = five and codes.bits == 8 and fits_five(codes)
    if codes.bits == 4:
        unsigned = (by_input.astype(np.int16) + 8).astype(np.uint8)
        packed = unsigned[:, 0::2] | (unsigned[:, 1::2] << 4)
    elif in_five:
        packed = five_codes(by_input)
    else:
        packed = by_input.view(np.uint8)
    if factors is not None:  # SIX_SCALES
        return np.ascontiguousarray(packed), six_records(*factors), no_zeros
    if (codes.bits == 4 or in_five) and k_factors(codes):  # K_SCALES: a K-quant's own factors (Q5_K's in 5 bits)
        return np.ascontiguousarray(packed), _factor_panels(codes), no_zeros
    if half_scales(codes):  # F16_SCALES: the file's fp16 d, and zeros of -0.0
        return np.ascontiguousarray(packed), _by_panel(codes.scale, np.float16), no_zeros
    scales = _by_panel(codes.scale, np.float32)
    if codes.bits == gguf_codes.SIXTEEN:  # each zero -0.0 (codes.decode)
        return np.ascontiguousarray(packed), scales, no_zeros
    return np.ascontiguousarray(packed), scales, _by_panel(codes.zero, np.float32)


F16_SCALES = 128
"""Added to the ``bits`` of fp32 rows' panels whose scales are fp16 values and zeros -0.0, not stored (blocks.h's
``F16_SCALES``)."""


def half_scales(codes: gguf_codes.Codes) -> bool:
    """Whether the panels of ``codes`` hold fp16 scales and no zeros: 4- or 8-bit codes whose every scale is an fp16
    value and every zero -0.0 (Q4_0, Q5_0 and Q8_0 as the file stores them: ``d`` and no offset). Their panels then
    read 4.5 bits an input instead of 6 (4-bit codes), or 8.5 instead of 10."""
    if codes.bits not in (4, 8) or codes.scale.size == 0:
        return False
    zero = codes.zero
    if not bool(np.all((zero == 0) & np.signbit(zero))):
        return False
    with np.errstate(over="ignore", invalid="ignore"):
        return bool(np.array_equal(codes.scale.astype(np.float16).astype(np.float32), codes.scale))


K_SCALES = 256
"""Added to the ``bits`` of fp32 rows' panels of Q4_K or Q5_K codes that hold its own factors instead of fp32 scales
and zeros (blocks.h's ``K_SCALES``)."""
SUPER = 8
"""Blocks a K-quant super-block holds."""


def k_factors(codes: gguf_codes.Codes) -> bool:
    """Whether the panels of ``codes`` can hold a K-quant's own factors
    (:attr:`~ttft_sse.engine.kernels.codes.Codes.factors`, which only Q4_K's 4-bit codes and Q5_K's 8-bit ones carry):
    whole super-blocks whose factors give back every scale and zero exactly (d*sc, then 8*scale - dmin*m, Q5_K's
    16*scale - dmin*m, one fp32 rounding each, as kernel.c computes them). Their panels then read 4.625 bits an input
    instead of 6 (Q5_K, its codes in 5 bits: 5.625 instead of 7)."""
    if codes.factors is None or codes.bits not in (4, 8) or codes.scale.shape[1] % SUPER:
        return False
    d, dmin, sc, m = codes.factors
    scale = np.repeat(d.astype(np.float32), SUPER, axis=1) * sc.astype(np.float32)
    minimum = np.repeat(dmin.astype(np.float32), SUPER, axis=1) * m.astype(np.float32)
    zero = np.float32(8 if codes.bits == 4 else 16) * scale - minimum
    return bool(np.array_equal(scale.view(np.uint32), codes.scale.view(np.uint32))) and bool(
        np.array_equal(zero.view(np.uint32), codes.zero.view(np.uint32))
    )


def _factor_panels(codes: gguf_codes.Codes) -> npt.NDArray[np.uint8]:
    """A K-quant's factors panel by panel, a record of 320 bytes a super-block: the 16 outputs' d, then their dmin
    (fp16), then each of the 8 blocks' 16 sc, then their 16 m (uint8); padding outputs all zero."""
    assert codes.factors is not None
    d, dmin, sc, m = codes.factors
    out, supers = d.shape
    padded = _padded(out)
    halves = [_by_panel(v.astype(np.float32), np.float16).view(np.uint8) for v in (d, dmin)]  # panels x supers x 32
    bytes_ = []
    for v in (sc, m):
        full = np.zeros((padded, supers * SUPER), np.uint8)
        full[:out] = v
        by = full.reshape(padded // PANEL, PANEL, supers, SUPER).transpose(0, 2, 3, 1)  # panel, super, block, output
        bytes_.append(np.ascontiguousarray(by).reshape(padded // PANEL, supers, SUPER * PANEL))
    return np.ascontiguousarray(np.concatenate([*halves, *bytes_], axis=2))


FIVE = 5
"""The ``bits`` of fp32 rows' panels of 8-bit codes of -16..15 laid in 5 bits (blocks.h's ``FIVE``:
:func:`five_codes`)."""
FIVE_PAIR = 20
"""Bytes of a :data:`FIVE` panel's two inputs: 16 of low nibbles, then 2 x 2 of fifth bits."""


def fits_five(codes: gguf_codes.Codes) -> bool:
    """Whether 8-bit ``codes`` all lie in -16..15 (the Q5 types' ``q - 16``), which :func:`five_codes` holds."""
    return codes.q.size > 0 and int(codes.q.min()) >= -16 and int(codes.q.max()) <= 15


def five_codes(by_input: npt.NDArray[np.int8]) -> npt.NDArray[np.uint8]:
    """Codes of -16..15 (panels x inputs x 16, each input's 16 outputs) in kernel.c's ``FIVE`` panels: panels x
    K/2 x 20 bytes, each two inputs' ``q + 16``: their low nibbles as 4-bit codes lie (byte n output n's, the first
    input's in the low nibble), then their fifth bits, 16 an input (bit n of a little-endian uint16: output n's): 5
    bits an input instead of 8."""
    panels, inputs, _ = by_input.shape
    unsigned = (by_input.astype(np.int16) + 16).astype(np.uint8)
    low = unsigned & 0x0F
    nibbles = low[:, 0::2] | (low[:, 1::2] << 4)  # panels x K/2 x 16
    fifth = (unsigned >> 4).astype(np.uint16) << np.arange(PANEL, dtype=np.uint16)
    words = fifth.sum(axis=2, dtype=np.uint16).astype("<u2").view(np.uint8).reshape(panels, inputs // 2, 4)
    return np.ascontiguousarray(np.concatenate([nibbles, words], axis=2))


def panel_bits(bits: int, scales: npt.NDArray[Any], laid: npt.NDArray[Any]) -> int:
    """The ``bits`` kernel.c takes for panels ``laid`` of codes of ``bits`` whose scales are ``scales``
    (:func:`panels`'s first two arrays): plus :data:`F16_SCALES` where they are fp16, :data:`K_SCALES` where they
    are Q4_K's factors, :data:`SIX_SCALES` where they are Q6_K's records (:func:`six_records`), :data:`SIX_PACKED`
    where its codes are in 6 bits too (48 bytes a panel's four inputs); 8-bit codes laid in 5 bits
    (:func:`five_codes`) are :data:`FIVE`'s."""
    if bits == 8 and laid.shape[-1] == FIVE_PAIR:
        bits = FIVE
    if scales.dtype == np.float16:
        return bits + F16_SCALES
    if scales.dtype != np.uint8:
        return bits
    if bits != gguf_codes.SIXTEEN:
        return bits + K_SCALES
    return bits + (SIX_PACKED if laid.shape[-1] == SIX_QUAD else SIX_SCALES)


SIX_SCALES = 1024
"""Added to the ``bits`` of fp32 rows' panels of Q6_K codes with records of factors (blocks.h's ``SIX_SCALES``)."""
SIX_PACKED = 512
"""Added instead where the codes are in 6 bits too (blocks.h's ``SIX_PACKED``)."""
SIX_QUAD = 48
"""Bytes of a :data:`SIX_PACKED` panel's four inputs (64 codes of 6 bits)."""
SIX_SUPER = 16
"""Scales (blocks of 16 inputs) a Q6_K super-block of 256 inputs holds."""


def six_factors(codes: gguf_codes.Codes) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int8]] | None:
    """Each super-block's factor ``D`` (outputs x super-blocks, fp32) and each block's signed ``sc`` (outputs x
    blocks) such that ``D * sc`` (one fp32 multiply, as kernel.c's) is the block's scale exactly, for every block
    of ``codes`` (Q6_K's); None where no such factors are found (kernel.c's SIX_PACKED takes it times 2^-26, exact
    for every fp16 ``d`` times a byte).
    ``D`` is the super-block's scale of largest magnitude over its ``sc``, tried from -128 (what llama.cpp's
    quantiser makes it) down in magnitude; each is checked, and where none fits the codes stay in 8 bits."""
    out, blocks = codes.scale.shape
    if blocks % SIX_SUPER:
        return None
    scaled = codes.scale.reshape(out, -1, SIX_SUPER)
    largest = np.take_along_axis(scaled, np.abs(scaled).argmax(axis=2)[..., None], axis=2)[..., 0]
    factor = np.zeros_like(largest)
    sc = np.zeros(scaled.shape, np.int8)
    left = np.flatnonzero(largest.reshape(-1) != 0)  # a super-block of zero scales: factor and sc 0
    flat_factor, flat_sc, flat_scaled = factor.reshape(-1), sc.reshape(-1, SIX_SUPER), scaled.reshape(-1, SIX_SUPER)
    for code in (c for m in range(128, 0, -1) for c in (-m, m) if c != 128):  # the likeliest first
        if left.size == 0:
            break
        d = largest.reshape(-1)[left] / np.float32(code)
        ratio = (flat_scaled[left] / d[:, None]).round()
        fits = (ratio >= -128) & (ratio <= 127)
        exact = (fits & (d[:, None] * ratio == flat_scaled[left])).all(axis=1)
        flat_factor[left[exact]] = d[exact]
        flat_sc[left[exact]] = ratio[exact].astype(np.int8)
        left = left[~exact]
    if left.size:
        return None
    return factor, sc.reshape(out, blocks)


def six_codes(codes: gguf_codes.Codes) -> npt.NDArray[np.uint8]:
    """Q6_K's codes in kernel.c's ``SIX_PACKED`` panels: panels x K/4 x 48 bytes, input 4t+j's output o the code
    ``w = 16 (o // 4) + 4 j + o % 4`` of its four inputs' 64, each ``q`` (-32..31) in 6 bits (two's complement) at
    bits ``6 w`` of the 48 little-endian bytes (six.h's six_quad); padding outputs all zero."""
    out, inputs = codes.q.shape
    padded = _padded(out)
    q = np.zeros((padded, inputs), np.uint8)
    q[:out] = codes.q.view(np.uint8) & 0x3F
    # panel, quad of inputs, output // 4, input in the quad, output % 4: 64 codes of 6 bits, little-endian
    quads = q.reshape(padded // PANEL, 4, 4, inputs // 4, 4).transpose(0, 3, 1, 4, 2).reshape(-1, 8, 8)
    words = np.zeros(quads.shape[:2], np.uint64)  # each 8 codes' 48 bits
    for i in range(8):
        words |= quads[..., i].astype(np.uint64) << np.uint64(6 * i)
    little = words.astype("<u8").view(np.uint8).reshape(*words.shape, 8)[..., :6]
    return np.ascontiguousarray(little).reshape(padded // PANEL, inputs // 4, SIX_QUAD)


def six_records(factor: npt.NDArray[np.float32], sc: npt.NDArray[np.int8]) -> npt.NDArray[np.uint8]:
    """Q6_K's scales as kernel.c's ``SIX_SCALES`` and ``SIX_PACKED`` panels hold them (:func:`six_factors`): panels x
    super-blocks x 320 bytes, each the 16 outputs' ``factor`` (fp32) then the 16 blocks' 16 ``sc``; padding outputs
    all zero."""
    factors = _by_panel(factor, np.float32).view(np.uint8)  # panels x supers x 64
    signed = np.zeros((_padded(sc.shape[0]), sc.shape[1]), np.int8)
    signed[: sc.shape[0]] = sc
    by = signed.reshape(factors.shape[0], PANEL, -1, SIX_SUPER).transpose(0, 2, 3, 1).view(np.uint8)
    return np.ascontiguousarray(np.concatenate([factors, np.ascontiguousarray(by).reshape(*factors.shape[:2], -1)], 2))


WIDE = 64
"""Added to the ``bits`` of int8 records of 4- or 8-bit codes whose tail holds fp32 scales and zeros (blocks.h's
``Q_WIDE``)."""


def records(codes: gguf_codes.Codes) -> npt.NDArray[np.uint8]:
    """``codes`` in the int8 kernel's layout (int8_rows.c): panels of :data:`PANEL` outputs (the last one padded with
    zero weights), each a record a block of 32 inputs: the unsigned codes four inputs a lane (4-bit ones: inputs
    8g..8g+3 in the low nibbles, 8g+4..8g+7 in the high ones), then the tail (:func:`record_bits` says which): the
    16 scales and the 16 offsets in fp16 where both are the file's own fp16 values (w = scale * code + offset:
    :func:`narrow`); else the 16 scales and the 16 zeros in fp32 (w = scale * q + zero, the codes' own); Q6_K's
    (:data:`~ttft_sse.engine.kernels.codes.SIXTEEN`) the 16 fp32 scales of the block's first 16 inputs, then those of
    its last 16. Quantised codes only (a dense type's are not: ``Codes.unquantised``)."""
    if codes.unquantised:
        raise ValueError(f"int8 records hold quantised codes, not the values of a dense type ({codes.bits})")
    out, inputs = codes.q.shape
    padded, blocks = _padded(out), inputs // gguf_codes.BLOCK
    unsigned = np.zeros((padded, inputs), np.uint8)
    shift = 8 if codes.bits == 4 else 128
    unsigned[:out] = (codes.q.astype(np.int16) + shift).astype(np.uint8)
    lanes: npt.NDArray[np.integer[Any]]  # uint8 (numpy types the shifted nibbles as signed)
    if codes.bits == 4:
        pairs = unsigned.reshape(padded // PANEL, PANEL, inputs // 8, 2, 4)  # panel, output, group, half, input
        lanes = (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).transpose(0, 2, 1, 3)  # panel, group, output, input
    else:
        lanes = unsigned.reshape(padded // PANEL, PANEL, inputs // 4, 4).transpose(0, 2, 1, 3)
    by_block = np.ascontiguousarray(lanes).reshape(padded // PANEL, blocks, -1)
    if codes.bits == gguf_codes.SIXTEEN:  # panels x blocks x (first half's 16, second half's 16)
        tail = [_by_panel(codes.scale, np.float32).reshape(padded // PANEL, blocks, -1).view(np.uint8)]
    elif narrow(codes):
        offset = codes.zero - shift * codes.scale
        tail = [_by_panel(values, np.float16).view(np.uint8) for values in (codes.scale, offset)]
    else:
        tail = [_by_panel(values, np.float32).view(np.uint8) for values in (codes.scale, codes.zero)]
    return np.ascontiguousarray(np.concatenate([by_block, *tail], axis=2))


def record_bits(bits: int, record_bytes: int) -> int:
    """The ``bits`` int8_rows.c takes for records of codes of ``bits`` whose records are ``record_bytes`` long: 4
    or 8 (fp16 tails), those plus :data:`WIDE` (fp32 ones), or SIXTEEN."""
    if bits == gguf_codes.SIXTEEN:
        return bits
    narrow_bytes = (256 if bits == 4 else 512) + 64
    return bits if record_bytes == narrow_bytes else bits + WIDE


def narrow(codes: gguf_codes.Codes) -> bool:
    """Whether the records of ``codes`` take fp16 tails: a scale each 32 inputs, every scale and offset an fp16
    value, and each offset plus the codes' shift times the scale the zero (Q4_0, Q4_1, Q5_0 and Q8_0 as the file
    stores them; not a K-quant's ``d*sc``, of up to 17 bits, nor Q5_1's ``m - 112*d``)."""
    if codes.bits not in (4, 8):
        return False
    shift = 8 if codes.bits == 4 else 128
    offset = codes.zero - shift * codes.scale
    with np.errstate(over="ignore", invalid="ignore"):
        if not all(np.array_equal(v.astype(np.float16).astype(np.float32), v) for v in (codes.scale, offset)):
            return False
    restored = offset.astype(np.float64) + shift * codes.scale.astype(np.float64)  # exact: fp16 values
    return np.array_equal(restored, codes.zero.astype(np.float64))


def _padded(outputs: int) -> int:
    """``outputs`` rounded up to whole panels."""
    return -(-outputs // PANEL) * PANEL


def _by_panel(per_block: npt.NDArray[np.float32], dtype: type[np.floating[Any]]) -> npt.NDArray[Any]:
    """A value per output and block (outputs x blocks) as ``dtype``, panel by panel: panels x blocks x 16, the
    padding outputs zero."""
    out, blocks = per_block.shape
    full = np.zeros((_padded(out), blocks), dtype)
    full[:out] = per_block
    return np.ascontiguousarray(full.reshape(-1, PANEL, blocks).transpose(0, 2, 1))


PROBED_OUTPUTS = 1024
"""At most this many of a layer's outputs, spread over all its panels, are checked against the fp64 reference (the
reference of a large LM head on every output costs a second of start-up, and a wrong build or layout shows in every
panel)."""


def probed_outputs(outputs: int, torch: Any) -> Any:
    """The outputs the kernel's load check (kernel.py) compares with the reference: every one of a small layer; of a
    large one, evenly spaced ones (each offset within a panel in turn) and the last panel whole (where the padding
    lies)."""
    if outputs <= PROBED_OUTPUTS:
        return torch.arange(outputs)
    step = -(-outputs // (PROBED_OUTPUTS - PANEL))
    if step % PANEL == 0:
        step += 1  # not always the same offset within a panel
    spread = torch.arange(0, outputs, step)
    last = torch.arange(max(0, outputs - PANEL), outputs)
    return torch.unique(torch.cat([spread, last]))
