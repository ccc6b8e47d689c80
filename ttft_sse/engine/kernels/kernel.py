"""The block kernel: fp32 rows times linear weights kept in a GGUF file's own blocks, on CPU (``TTFT_GGUF_KERNEL``).

transformers expands a GGUF's quantised weights to fp32, 32 bits an input, which a decode step reads whole;
``kernel.c`` multiplies fp32 rows by the file's codes instead (engine/kernels/codes.py: Q4_0 to Q6_K as 4-bit or 8-bit
codes), laid out by :func:`panels` in panels of 16 outputs: for each input it expands a panel's 16 codes to exactly
the fp32 weights transformers' loader gives and multiplies them into 16 outputs with one fused multiply-add. An
unquantised file's F16, BF16 and F32 matrices lie in the same panels as their values, widened exactly. Decode steps
and short prompts gain; long prompts lose a little (figures: docs/engine.md).

The answers are the fp32 model's: the same weights and fp32 arithmetic, summed in another order than oneDNN's. And
each row's result is the same bits whatever else the call holds (checked at load): a stream's answer does not depend
on the batch it shares steps with, which oneDNN's GEMMs, whose blocking depends on the row count, do not promise.

``TTFT_GGUF_ACTIVATIONS=int8`` (off by default) quantises each row first, per block of 32 inputs, to int8 steps of
max|x| / 127, as llama.cpp does for these formats, and multiplies by the codes in integers (AVX-512 VNNI, or AVX2 with
F16C; laid out by :func:`records`; both builds give the same bits). Each row's result is still independent of the
others in the call, but not of rounding: an activation that moves by an fp32 rounding can cross a step and move by
1/127 of its block. So the answers are the int8 model's, not the fp32 model's, hence off by default. Every quantised
type has int8 records (:func:`records`: fp16 scales and offsets where they are the file's fp16 values, fp32 ones for
the K-quants and Q5_1, Q6_K's two scales a block); a dense type's layers keep fp32 rows (``Codes.unquantised``).

``TTFT_DEGRADE=int8`` keeps fp32 rows as the start-up arithmetic and gives every layer the records too
(:func:`apply`'s ``degrade``), so that the engine can switch to int8 rows at run time: a thread's passes use them
while :data:`ROWS` says so for that thread (the batching thread between two steps, a generation's thread at its
start), and every other thread keeps fp32 rows.

The kernel is C, built at the first start for this CPU (``-march=native``: AVX-512 or AVX2 with FMA) and loaded by
engine/kernels/compiler.py. Without a compiler, on another CPU family, or if the
kernel disagrees with its fp64 reference on a probe, the engine says why (``weights_not_blocks``) and keeps the fp32
layers. So it does with more than one torch thread (``TTFT_THREADS``): the kernel runs on one, and on several
oneDNN's fp32 GEMMs compute a long prompt faster.

The kernel's own helper threads (:func:`start_helpers`, ``TTFT_KERNEL_HELPERS``) take a share of each large call's
panels, but only on a core nothing else wants: they run at ``SCHED_IDLE``, and the calling thread takes back a chunk a
helper holds too long, so it never waits on one that does not run (torch's spinning threads, on a busy core, do). The
results are the same bits shared or not.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import structlog

from ttft_sse.engine.kernels import arrangement, compiler, matches, weights
from ttft_sse.engine.kernels import codes as gguf_codes
from ttft_sse.engine.kernels.layouts import (
    F16_SCALES,
    FIVE,
    FIVE_PAIR,
    PANEL,
    SIX_PACKED,
    panel_bits,
    probed_outputs,
    record_bits,
)
from ttft_sse.engine.kernels.stored import Stored

log = structlog.get_logger("ttft_sse.engine")

SOURCE = Path(__file__).with_name("kernel.c")
SOURCES = (SOURCE, *(Path(__file__).with_name(name) for name in ("int8_rows.c", "helpers.c", "decoder.c")))
"""The kernel's library: the kernel (fp32 rows; int8 rows; the helper threads), and decoder layers around it
(engine/library/decoder.py)."""
PROBE_ROWS = (1, 9, 17)
"""Row counts the load probe checks: one (one tile, codes expanded in registers), nine (two tiles; with AVX2 the
panels expanded once and reused by them) and seventeen (the panels expanded once on every build: kernel.c's
``FUSED_ROWS``)."""


def build(directory: Path) -> Path:
    """The kernel's library (:data:`SOURCES`) built for this CPU in ``directory`` (compiler.build)."""
    return compiler.build(directory, SOURCES, "blocks")


def start(directory: Path) -> None:
    """:func:`build`'s compile started in the background (compiler.start)."""
    compiler.start(directory, SOURCES, "blocks")


FP32, INT8 = "ttft_blocks_linear", "ttft_q8_linear"
"""The kernel's two functions: fp32 rows (:func:`panels`), and rows quantised to int8 (:func:`records`)."""
_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_ARGUMENTS = {
    FP32: [_PTR, _I64, _I64, _PTR, _INT, _PTR, _PTR, _I64, _PTR],  # x, M, K, codes, bits, scales, zeros, N, y
    INT8: [_PTR, _I64, _I64, _PTR, _INT, _I64, _PTR],  # x, M, K, records, bits, N, y
}


def function(path: Path, name: str = FP32) -> Any:
    """The function ``name`` (:data:`FP32` or :data:`INT8`) of the library at ``path``."""
    return compiler.load(path, name, tuple(_ARGUMENTS[name]))


class HelperCounts(NamedTuple):
    """What the helper threads did since they started (helpers.c's ``ttft_helper_stats``)."""

    helpers: int
    calls: int  # calls shared
    by_caller: int  # chunks the calling thread computed
    by_helpers: int  # chunks the helpers computed
    taken_back: int  # chunks a helper held too long, computed by the caller instead


def start_helpers(path: Path, count: int) -> int:
    """Start ``count`` helper threads in the library at ``path`` (once a process: later calls add none); returns how
    many run. From then on a call of the kernel large enough shares its panels with them (helpers.c). They run at
    SCHED_IDLE, on a core nothing else wants, and the caller never waits for one that does not run."""
    if count <= 0:
        return 0
    return max(0, int(compiler.load(path, "ttft_helper_start", (ctypes.c_int,))(count)))


def helper_counts(path: Path) -> HelperCounts:
    """What the helper threads of the library at ``path`` did so far."""
    counts = (ctypes.c_int64 * 4)()
    helpers = compiler.load(path, "ttft_helper_stats", (ctypes.c_void_p,))(ctypes.addressof(counts))
    return HelperCounts(int(helpers), *(int(n) for n in counts))


def fence(path: Path) -> None:
    """Return once no helper thread of the library at ``path`` is inside a chunk: before freeing memory a chunk
    taken back from a helper may still read (a layer's codes, a KV cache its attention reads: helpers.c)."""
    compiler.load(path, "ttft_helper_fence", ())()


def takes_int8(path: Path) -> bool:
    """Whether the library at ``path`` multiplies int8 rows (it was built for a CPU with AVX-512 VNNI, or AVX2 and
    F16C)."""
    return bool(function(path, INT8)(None, 0, gguf_codes.BLOCK, None, 4, 0, None) == 0)


def takes_six(path: Path) -> bool:
    """Whether the library at ``path`` multiplies fp32 rows by Q6_K's codes in 6 bits (layouts.six_codes: it was
    built for a CPU with AVX-512 VBMI); elsewhere they are held in 8."""
    return _takes_panels(path, gguf_codes.SIXTEEN + SIX_PACKED)


def takes_five(path: Path) -> bool:
    """Whether the library at ``path`` multiplies fp32 rows by the Q5 types' codes in 5 bits (layouts.five_codes: it
    was built for a CPU with AVX-512); elsewhere they are held in 8."""
    return _takes_panels(path, FIVE + F16_SCALES)


def _takes_panels(path: Path, bits: int) -> bool:
    """Whether the library at ``path`` multiplies fp32 rows by panels of ``bits`` (a call of no rows: 0 where it
    does, kernel.c's fp32_takes)."""
    return bool(function(path, FP32)(None, 0, 256, None, bits, None, None, 0, None) == 0)


class Applied(NamedTuple):
    """What :func:`apply` did."""

    activations: str | None  # "int8" where any layer on the kernel takes int8 rows, else "fp32"; None: no layer
    by_type: dict[str, str]  # the path of each GGUF type's layers (matches.by_type); empty where the kernel is off


class ThreadRows(threading.local):
    """The rows the calling thread's passes give the layers that hold both arrangements (``TTFT_DEGRADE=int8``):
    int8 ones while ``int8`` is set, else the layers' start-up rows. Every thread starts without it; only the
    thread that sets it is switched, so a pass in another thread (the single engine's, beside the batch) keeps its
    own. Layers holding one arrangement ignore it."""

    int8 = False


ROWS = ThreadRows()


@contextmanager
def int8_rows(on: bool = True) -> Iterator[None]:
    """The calling thread's :data:`ROWS` set to ``on`` for the length of the block, then back to what it was."""
    before = ROWS.int8
    ROWS.int8 = on
    try:
        yield
    finally:
        ROWS.int8 = before


class Refused(RuntimeError):
    """The block kernel cannot serve the model as asked (:func:`apply` with ``degrade``); the message says why."""


def apply(
    model: Any,
    stored: Stored,
    torch: Any,
    *,
    directory: Path,
    cache: Path | None = None,
    activations: str = "fp32",
    degrade: bool = False,
) -> Applied:
    """Make every linear layer of ``model`` whose weight the GGUF file ``stored`` holds in one of the types
    engine/kernels/codes.py reads (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; F16, BF16, F32 as their values) a
    ``BlockLinear`` on those codes, read from the file and laid out for the kernel built in ``directory``; the layers'
    arrays are kept in the model's ``cache`` directory (engine/kernels/arrangement.py), which a later start maps instead
    of reading and laying out the codes again. A layer's weight may be on torch's meta device: it is never read, the
    file is. ``activations``:
    ``"int8"`` quantises each row per block of 32 inputs first, as llama.cpp does, in each quantised layer
    (a dense type's keep fp32 rows, ``Codes.unquantised``, as all do on a CPU with neither AVX-512 VNNI nor AVX2
    and F16C, where the log says so); ``"fp32"`` keeps the fp32 model's arithmetic.

    A layer gets codes only where they give back, bit for bit, the file's own dequantisation of rows spread over its
    weight (what transformers' loader gives the fp32 model: :func:`arrangement.checked_rows`), and each kind of
    layer's kernel agrees with its fp64 reference on a probe. Returns the activations the layers use (None when
    nothing changed: logged with the reason when the kernel cannot be built or disagrees with its reference on a
    probe) and the path of each GGUF type's layers, also logged. A changed layer drops its weight unless another
    module shares it (a tied LM head's is the embedding's). Nothing changes either when torch runs on more than one
    thread: the kernel runs on one, and oneDNN's fp32 GEMMs on all of them are faster for prompts.

    ``degrade`` (with fp32 ``activations``): each layer holds the int8 rows' records beside its fp32 panels, both
    checked on the probe, and a thread computes with them while :data:`ROWS` says so (a dense type's layers keep
    fp32 rows in both). Where that cannot be (the reasons above, or a CPU without int8 rows), raises
    :class:`Refused` with the reason instead."""
    if degrade and activations != "fp32":
        raise ValueError("degrade adds int8 rows to fp32 ones: activations must be fp32")
    try:
        return _apply(model, stored, torch, directory, cache, activations, degrade)
    except Refused as exc:
        if degrade:
            raise
        log.warning("weights_not_blocks", reason=str(exc))
        return Applied(None, {})


def _apply(
    model: Any,
    stored: Stored,
    torch: Any,
    directory: Path,
    cache: Path | None,
    activations: str,
    degrade: bool,
) -> Applied:
    threads = torch.get_num_threads()
    if threads > 1:
        raise Refused(f"the block kernel runs on one thread; torch has {threads}")
    try:
        library = build(directory)
    except (OSError, RuntimeError) as exc:
        raise Refused(f"the kernel was not built: {exc}") from exc
    if (activations == "int8" or degrade) and not takes_int8(library):
        if degrade:
            raise Refused("the CPU has neither AVX-512 VNNI nor AVX2 with F16C, which int8 rows need")
        reason = "the CPU has neither AVX-512 VNNI nor AVX2 with F16C: the rows stay fp32"
        log.warning("activations_not_int8", reason=reason)
        activations = "fp32"
    layers = {
        name: m
        for name, m in model.named_modules()
        if type(m) is torch.nn.Linear and m.weight.dtype == torch.float32 and m.in_features % gguf_codes.BLOCK == 0
    }
    kinds = {name: stored.kind(f"{name}.weight") for name in layers}
    shapes = {name: (m.out_features, m.in_features) for name, m in layers.items()}
    candidates = [name for name in layers if _has_codes(stored, name, shapes[name])]
    spread = {name: arrangement.checked_rows(shapes[name][0]) for name in candidates}
    checked = {name: stored.rows(f"{name}.weight", spread[name]) for name in candidates}
    checks = {name: (shapes[name], arrangement.rows_checksum(rows)) for name, rows in checked.items()}
    if not candidates:
        paths = matches.by_type(kinds, {}, activations)
        reason = "no linear weight of the model is stored in a type the kernel runs"
        if degrade:
            raise Refused(reason)
        log.warning("weights_not_blocks", reason=reason, by_type=paths)
        return Applied(None, paths)
    path = None if cache is None else arrangement.path_for(cache, activations, degrade)
    key = arrangement.key(library, activations, degrade)
    kept = None if path is None else arrangement.load(path, key, kinds, checks)
    fresh = kept is None
    if kept is None:
        six, five = takes_six(library), takes_five(library)

        def entries() -> Iterator[tuple[str, arrangement.Entry]]:
            for name in candidates:
                codes = stored.codes(f"{name}.weight")
                if codes is None or not np.array_equal(codes.rows(spread[name]).dense(), checked[name]):
                    log.warning("layer_codes_inexact", layer=name, kind=kinds[name])  # stays off the kernel
                    continue
                rows = "fp32" if activations == "int8" and codes.unquantised else activations
                yield name, arrangement.laid_out(codes, rows, degrade, checks[name][1], six, five)

        if path is not None and arrangement.save(path, key, kinds, entries()):
            kept = arrangement.load(path, key, kinds, checks)
        if kept is None:  # no cache directory, or one that cannot be written: held in memory
            kept = arrangement.Kept(kinds, dict(entries()))
    entries_kept = kept.entries
    if not entries_kept:  # every candidate's codes were inexact
        paths = matches.by_type(kinds, {}, activations)
        if degrade:
            raise Refused("no linear weight's codes give back the file's dequantisation")
        log.warning("weights_not_blocks", reason="no linear weight's codes give back the file's weights", by_type=paths)
        return Applied(None, paths)
    rows = {name: entry.rows for name, entry in entries_kept.items()}
    changed = [layers[name] for name in entries_kept]
    for name, layer in zip(entries_kept, changed, strict=True):
        _hold_entry(layer, entries_kept[name], library, torch)
    try:
        kinds_held = {(layer.panel_bits, layer.activations, layer.record_bits or 0) for layer in changed}
        by_layer = dict(zip(changed, entries_kept, strict=True))
        for kind in sorted(kinds_held):  # one layer of each layout: panels' bits and scales, rows, records' tail
            probed = next(m for m in changed if (m.panel_bits, m.activations, m.record_bits or 0) == kind)
            outputs = probed_outputs(probed.out_features, torch)
            weight = torch.from_numpy(stored.rows(f"{by_layer[probed]}.weight", outputs.numpy()))
            _check(probed, torch, weight, outputs, int8=kind[1] == "int8")
            if degrade and probed.records is not None:  # dense layers keep fp32 rows in the int8 mode too
                with int8_rows():
                    _check(probed, torch, weight, outputs, int8=True)
    except RuntimeError as exc:
        for layer in changed:  # back to the plain linear layers they were
            layer.fence()  # as BlockLinear's __del__ does: a helper may still read the codes (helpers.c)
            layer.__class__ = torch.nn.Linear
            del layer.arrays, layer.multiply, layer.bits, layer.activations, layer.fence
            del layer.records, layer.int8_multiply, layer.record_bits, layer.panel_bits, layer.mapped
        if fresh and path is not None:  # laid out now and failed its probe: not kept for the next start
            path.unlink(missing_ok=True)
        raise Refused(str(exc)) from exc
    others = (m for m in model.modules() if not isinstance(m, block_linear_class()))
    shared = {id(p) for m in others for p in m.parameters(recurse=False)}
    for layer in changed:
        if id(layer.weight) not in shared:  # never read: its memory (or its place on the meta device) goes
            layer.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    in_five = sum(entry.rows == "fp32" and entry.arrays[0].shape[-1] == FIVE_PAIR for entry in entries_kept.values())
    counts = {bits: sum(entry.bits == bits for entry in entries_kept.values()) for bits in (4, 8, gguf_codes.SIXTEEN)}
    dense = sum(entry.bits in gguf_codes.DENSE_DTYPES for entry in entries_kept.values())
    used = "int8" if "int8" in rows.values() else "fp32"
    paths = matches.by_type(kept.kinds, rows, activations)
    log.info(
        "weights_blocks",
        layers=len(changed),
        q4=counts[4],
        q8=counts[8] - in_five,
        q5=in_five,
        q6=counts[gguf_codes.SIXTEEN],
        dense=dense,
        activations=used,
        by_type=paths,
    )
    return Applied(used, paths)


def _has_codes(stored: Stored, name: str, shape: tuple[int, int]) -> bool:
    """Whether the file holds the layer ``name``'s weight as a matrix of ``shape`` in a type with codes."""
    tensor = stored.tensor(f"{name}.weight")
    typed = tensor is not None and (tensor.kind in gguf_codes.FORMATS or tensor.kind in gguf_codes.DENSE)
    return typed and tensor is not None and tensor.shape == shape


def _check(layer: Any, torch: Any, weight: Any, probed: Any, *, int8: bool) -> None:
    """The layer against its reference in fp64 on the outputs ``probed`` (layouts.probed_outputs), whose fp32
    weights, as the file's dequantisation gives them, are ``weight`` (the rows the calling thread gives it are
    quantised first where ``int8``); and each row of a call against the same row alone (bit for bit, every
    output)."""
    with torch.no_grad():
        weight = weight.double()
        bias = None if layer.bias is None else layer.bias[probed].double()
    for count in PROBE_ROWS:
        rows = weights.probe_rows(torch, count, layer.in_features)
        with torch.no_grad():
            seen = quantised_rows(rows, torch) if int8 else rows.double()
            want = torch.nn.functional.linear(seen, weight, bias)
            got = layer(rows)
            alone = torch.cat([layer(rows[i : i + 1]) for i in range(count)])
        kind = "the block kernel" + (" with int8 rows" if ROWS.int8 and layer.records is not None else "")
        if not weights.agrees(got[:, probed], want):
            raise RuntimeError(f"{kind} disagrees with its fp64 reference at {count} rows")
        if not torch.equal(got, alone):
            raise RuntimeError(f"{kind}'s rows depend on the other rows at {count} rows")


def quantised_rows(rows: Any, torch: Any) -> Any:
    """``rows`` (fp32) as the int8 kernel sees them, in fp64: each block of 32 inputs rounded to multiples of
    d = max|x| / 127 (llama.cpp's Q8_0, halves to even)."""
    blocks = rows.reshape(rows.shape[0], -1, gguf_codes.BLOCK)
    largest = blocks.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(largest > 0, 127.0 / largest, torch.zeros_like(largest))
    steps = torch.round(blocks * inverse)
    return (steps.double() * (largest / 127.0).double()).reshape(rows.shape)


def _attach(
    layer: Any, codes: gguf_codes.Codes, library: Path, activations: str, torch: Any, degrade: bool = False
) -> None:
    """Make ``layer`` a ``BlockLinear`` on ``codes`` with the kernel of the library at ``library``; with ``degrade``,
    holding the int8 rows' records too."""
    check = arrangement.rows_checksum(codes.rows(arrangement.checked_rows(codes.q.shape[0])).dense())
    entry = arrangement.laid_out(codes, activations, degrade, check, takes_six(library), takes_five(library))
    _hold_entry(layer, entry, library, torch)


def _hold_entry(layer: Any, entry: arrangement.Entry, library: Path, torch: Any) -> None:
    """Make ``layer`` a ``BlockLinear`` on the arrays of ``entry`` with the kernel of the library at ``library``."""
    layer.kernel = function(library, INT8 if entry.rows == "int8" else FP32)
    layer.fence = compiler.load(library, "ttft_helper_fence", ())
    layer.bits = entry.bits
    layer.activations = entry.rows
    layer.mapped = entry.mapped
    layer.records = None if entry.records is None else torch.from_numpy(entry.records)
    held_records = entry.arrays[0] if entry.rows == "int8" else entry.records
    # int8_rows.c's bits for the records (their tail by their length), for every int8 call of this layer
    layer.record_bits = None if held_records is None else record_bits(entry.bits, held_records.shape[-1])
    # kernel.c's bits for fp32 rows' panels (fp16 scales or not, by their dtype); a dense layer's are its bits
    fp32 = entry.rows == "fp32" and entry.bits not in gguf_codes.DENSE_DTYPES
    layer.panel_bits = panel_bits(entry.bits, entry.arrays[1], entry.arrays[0]) if fp32 else entry.bits
    _hold(layer, tuple(torch.from_numpy(a) for a in entry.arrays))
    if layer.records is not None:
        int8, held = function(library, INT8), layer.records.data_ptr()
        inputs, outputs, bits = layer.in_features, layer.out_features, layer.record_bits
        layer.int8_multiply = lambda x, m, y: int8(x, m, inputs, held, bits, outputs, y)
    layer.__class__ = block_linear_class()


def _hold(layer: Any, arrays: tuple[Any, ...]) -> None:
    """``layer`` (being made a ``BlockLinear``) on ``arrays``, its codes in the kernel's layout for its start-up
    rows; without records, int8 rows (:data:`ROWS`) compute with these too."""
    kernel, inputs, outputs, bits = layer.kernel, layer.in_features, layer.out_features, layer.panel_bits
    layer.arrays = arrays
    pointers = [a.data_ptr() for a in arrays]
    if layer.activations == "int8":
        held_bits = layer.record_bits
        layer.multiply = lambda x, m, y: kernel(x, m, inputs, pointers[0], held_bits, outputs, y)
    else:
        layer.multiply = lambda x, m, y: kernel(x, m, inputs, pointers[0], bits, pointers[1], pointers[2], outputs, y)
    if layer.records is None:
        layer.int8_multiply = layer.multiply


def join(layers: list[Any], torch: Any) -> tuple[Any, ...] | None:
    """One layer's arrays (codes, scales, zeros) holding the outputs of ``layers`` (``BlockLinear`` layers with fp32
    rows, on the same inputs, with panels of the same bits and scales) one after the other, panel after panel; each
    layer then computes on its own panels of them, so the codes are held once. A panel's outputs are computed from
    its own codes alone, so each output has the same bits from the joined layer as from its own. None where they
    cannot be joined: int8 rows (records), other inputs or panels, or a layer before the last whose last panel is
    padded."""
    first = layers[0]
    if any(
        m.activations != "fp32" or m.in_features != first.in_features or m.panel_bits != first.panel_bits
        for m in layers
    ) or any(m.out_features % PANEL for m in layers[:-1]):
        return None
    joined = tuple(torch.cat([m.arrays[i] for m in layers]) for i in range(3))
    first.fence()  # no helper thread still reads the layers' arrays (helpers.c: one fence for every layer)
    start = 0
    for m in layers:
        count = m.arrays[0].shape[0]  # panels
        before, mapped = m.arrays, m.mapped
        _hold(m, tuple(a[start : start + count] for a in joined))
        if mapped:  # its own arrays, views of the kept file, are read no more
            arrangement.release(before)
        start += count
    return joined


@functools.cache
def block_linear_class() -> type[Any]:
    """``torch.nn.Linear`` computed by the block kernel from its codes (fp32 in, fp32 out)."""
    import torch

    class BlockLinear(torch.nn.Linear):  # type: ignore[misc]
        arrays: tuple[Any, ...]  # the codes in the kernel's layout (kept alive: multiply holds their addresses)
        multiply: Callable[[int, int, int], int]  # (rows' address, row count, output's address) -> status
        # TTFT_DEGRADE=int8: the codes as int8 rows' records (kept alive: int8_multiply holds their address), else None
        records: Any
        int8_multiply: Callable[[int, int, int], int]  # multiply for a thread on int8 rows (ROWS); else multiply
        kernel: Any  # kernel.c's function for its start-up rows (fp32 or int8)
        bits: int
        record_bits: int | None  # int8_rows.c's bits for its records (layouts.record_bits); None without records
        panel_bits: int  # kernel.c's bits for its fp32 rows' panels (layouts.panel_bits)
        mapped: bool  # its arrays are views of the kept arrangement file's mapping (arrangement.release)
        activations: str
        fence: Callable[[], int]  # helpers.c's ttft_helper_fence

        def __del__(self) -> None:
            # Before the codes go: a helper thread may still be reading them (a chunk the caller took back from it,
            # helpers.c), and it is done within a chunk once it runs.
            fence = self.__dict__.get("fence")
            if fence is not None:
                fence()

        def forward(self, x: Any) -> Any:
            # As few torch calls as it takes: a forward pass of the bundled model makes 211 of these, and each torch
            # call costs a few µs even when it changes nothing (no reshape or view: the output is made in its shape).
            if x.dtype != torch.float32 or not x.is_contiguous():
                y = self.forward(x.to(torch.float32).contiguous())
                return y if x.dtype == torch.float32 else y.to(x.dtype)
            y = torch.empty((*x.shape[:-1], self.out_features))
            multiply = self.int8_multiply if ROWS.int8 else self.multiply
            if multiply(x.data_ptr(), x.numel() // self.in_features, y.data_ptr()) != 0:
                raise MemoryError("the block kernel could not allocate its buffer")
            return y if self.bias is None else y + self.bias

    return BlockLinear
