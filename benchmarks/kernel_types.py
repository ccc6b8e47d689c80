"""The block kernel's speed by GGUF type: one linear layer a type, the same shape, on the kernel as the engine puts
it there (engine/kernels/kernel.py's ``apply``), and torch's fp32 ``nn.Linear`` beside it.

    .venv/bin/python benchmarks/kernel_types.py [--shape 576x1536] [--rows 1,4] [--types Q4_0,Q8_0,Q4_K,Q6_K] [--int8]
        [--avx2] [--q6-layouts] [--helpers 1] [--copies 24]

Prints, for each type and row count, the median and the least time a call over ``--repeats`` timed batches (the types
take turns, batch by batch) and the picoseconds a weight (the median over outputs x inputs). The blocks are random bytes
with fp16 scales of a plausible size: the kernel's speed does not depend on the values. One torch thread, as the engine
runs the kernel. ``--int8`` measures each type with int8 rows too (``TYPE+int8``: ``TTFT_GGUF_ACTIVATIONS=int8``).
``--avx2`` measures the kernel's AVX2 build (``-mno-avx512f``: what a CPU without AVX-512 runs) on this one.
``--q6-layouts`` adds Q6_K in the layouts this build does not pick: ``Q6_K/sc`` (8-bit codes, the scales as a factor
and a byte: what a build without AVX-512 VBMI picks) and ``Q6_K/fp32`` (8-bit codes, fp32 scales: the layout before
those). ``--helpers N`` starts the kernel's helper threads, as the server does (one on two cores). ``--copies N``
makes N copies of each layer and calls them in turn, so that, with enough of them to pass the last-level cache, each
call reads its weights from memory, as a decode step of a model larger than the caches does.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import gguf
import numpy as np
import torch

from ttft_sse.engine.kernels import compiler, kernel, layouts
from ttft_sse.engine.kernels.compiler import KERNEL_DIR
from ttft_sse.settings import Settings

SCALES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2)}
SCALES["Q6_K"] = (208,)  # where each block's fp16 d (and m or dmin) lie


def random_blocks(kind: str, outputs: int, inputs: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of ``kind`` for an ``outputs`` x ``inputs`` weight, each fp16 field near 1e-3."""
    qtype = gguf.GGMLQuantizationType[kind]
    per_block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(outputs * inputs // per_block, size), dtype=np.uint8)
    for at in SCALES[kind]:
        blocks[:, at : at + 2] = (rng.random((len(blocks), 1)) * 1e-3 + 1e-4).astype(np.float16).view(np.uint8)
    return blocks.reshape(outputs, -1)


def layer_of(kind: str, outputs: int, inputs: int, directory: Path, work: Path, activations: str) -> torch.nn.Module:
    """A linear layer holding gguf's dequantisation of random ``kind`` blocks, put on the kernel with
    ``activations`` rows."""
    blocks = random_blocks(kind, outputs, inputs, np.random.default_rng(0))
    path = work / f"{kind}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("weight", blocks, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    dense = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind]).astype(np.float32)
    model = torch.nn.Sequential(torch.nn.Linear(inputs, outputs, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(torch.from_numpy(dense))
    applied = kernel.apply(model, path, torch, directory=directory, activations=activations)
    if applied.activations != activations:
        raise SystemExit(f"{kind}: not on the kernel with {activations} rows: {applied.by_type}")
    return model[0]


def calls_in(copies: list[torch.nn.Module], x: torch.Tensor, seconds: float) -> int:
    """How many calls (each of the next copy in turn) on ``x`` take about ``seconds`` (after a warm-up)."""
    for at in range(max(20, len(copies))):
        copies[at % len(copies)](x)
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        copies[calls % len(copies)](x)
        calls += 1
    return calls


def timed(layers: dict[str, list[torch.nn.Module]], rows: int, inputs: int, repeats: int) -> dict[str, list[float]]:
    """Seconds a call of ``rows`` rows of each layer (its copies called in turn), ``repeats`` batches of about 20 ms
    each, the layers taking turns batch by batch (so that a busy spell of the machine falls on all of them alike)."""
    x = torch.randn(rows, inputs)
    samples: dict[str, list[float]] = {kind: [] for kind in layers}
    with torch.no_grad():
        calls = {kind: calls_in(copies, x, 0.02) for kind, copies in layers.items()}
        for _ in range(repeats):
            for kind, copies in layers.items():
                start = time.perf_counter()
                for at in range(calls[kind]):
                    copies[at % len(copies)](x)
                samples[kind].append((time.perf_counter() - start) / calls[kind])
    return samples


def q6_layouts(outputs: int, inputs: int, directory: Path, work: Path) -> dict[str, torch.nn.Module]:
    """Q6_K in the layouts the build does not pick: 8-bit codes with the factor-and-byte scales (``/sc``), and with
    fp32 scales (``/fp32``)."""
    layers = {}
    with mock.patch.object(kernel, "takes_six", lambda path: False):
        layers["Q6_K/sc"] = layer_of("Q6_K", outputs, inputs, directory, work, "fp32")
        with mock.patch.object(layouts, "six_factors", lambda codes: None):
            layers["Q6_K/fp32"] = layer_of("Q6_K", outputs, inputs, directory, work, "fp32")
    return layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="576x1536", help="outputs x inputs (inputs: whole super-blocks of 256)")
    parser.add_argument("--rows", default="1,4", help="rows a call, comma-separated")
    parser.add_argument("--types", default="Q4_0,Q8_0,Q4_K,Q6_K", help="GGUF types, comma-separated")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--int8", action="store_true", help="each type with int8 rows too")
    parser.add_argument("--avx2", action="store_true", help="the kernel's AVX2 build (-mno-avx512f)")
    parser.add_argument("--q6-layouts", action="store_true", help="Q6_K in the layouts the build does not pick too")
    parser.add_argument("--helpers", type=int, default=0, help="the kernel's helper threads (default 0)")
    parser.add_argument(
        "--copies", type=int, default=1, help="copies of each layer, called in turn (enough: read from memory)"
    )
    args = parser.parse_args()
    outputs, inputs = (int(n) for n in args.shape.split("x"))
    torch.set_num_threads(1)
    directory = Settings().cache_dir / KERNEL_DIR
    if args.avx2:
        compiler.FLAGS = (*compiler.FLAGS, "-mno-avx512f")  # its own hash: built beside the native one
    with tempfile.TemporaryDirectory() as work:
        arms = [(kind, "fp32") for kind in args.types.split(",")]
        if args.int8:
            arms += [(kind, "int8") for kind in args.types.split(",")]
        layers = {
            kind + ("+int8" if rows == "int8" else ""): [
                layer_of(kind, outputs, inputs, directory, Path(work), rows) for _ in range(args.copies)
            ]
            for kind, rows in arms
        }
        if args.q6_layouts:
            made = [q6_layouts(outputs, inputs, directory, Path(work)) for _ in range(args.copies)]
            layers |= {kind: [copy[kind] for copy in made] for kind in made[0]}
        if args.helpers:
            kernel.start_helpers(kernel.build(directory), args.helpers)
        fp32 = [torch.nn.Linear(inputs, outputs, bias=False) for _ in range(args.copies)]
        build = ("AVX2 build" if args.avx2 else "native build") + f", {args.helpers} helper threads"
        copies = f", {args.copies} copies a type called in turn" if args.copies > 1 else ""
        print(f"{outputs} x {inputs} weight, one thread, {build}{copies}; {args.repeats} batches a type, taking turns")
        print(f"{'type':10} {'rows':>4} {'µs median':>10} {'µs least':>9} {'ps a weight (median)':>21}")
        for rows in (int(n) for n in args.rows.split(",")):
            for kind, seconds in timed({**layers, "fp32": fp32}, rows, inputs, args.repeats).items():
                median, least = statistics.median(seconds), min(seconds)
                weight = median * 1e12 / (outputs * inputs)
                print(f"{kind:10} {rows:>4} {median * 1e6:>10.1f} {least * 1e6:>9.1f} {weight:>21.2f}")


if __name__ == "__main__":
    main()
