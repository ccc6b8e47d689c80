"""The C attention (engine/kernels/attention.c) of one request's new rows over a long cached prefix: the first request
behind a warm system prompt, whose few dozen new rows attend to ~1,150 keys.

    python benchmarks/attention_rows.py [--rows 1,8,30,128] [--keys 1150] [--avx2] [--also OLD.c] [--helpers 1]

Times ``ttft_paged_attention`` (fp32 cache) and ``ttft_paged_attention_f16`` (f16 cache) for one request of each row
count whose rows see ``--keys`` keys in all (its past, then its new rows: the last row sees them all), in the bundled
model's shape (9 query heads on 3 KV heads of 64), one thread. The keys lie in the paged cache's layout ([rows,
kv_heads, dim]), in the order of their rows, as a prefix's pages hold them; one cache a layer (``--layers``, called in
turn), so that, as in the model, each call reads keys another layer's calls have pushed out of the core's caches.
Prints the least and the median time of a call (one layer) over ``--repeats`` batches of about 20 ms, the arms taking
turns batch by batch. ``--also FILE`` adds another attention.c (an older version: ``git show REV:PATH > FILE``) as an
arm beside the package's, built with the same flags; ``--avx2`` builds both without AVX-512 (what a CPU without it
runs). ``--helpers N`` starts the kernel's helper threads, as the server does (one on two cores), and shares each call
with them as a batched step does (helpers.c, this tree's for every arm).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from ttft_sse.engine.kernels import attention, compiler, kernel
from ttft_sse.engine.kernels.compiler import KERNEL_DIR
from ttft_sse.settings import Settings

HEADS, KV_HEADS, DIM = 9, 3, 64


def functions(source: Path, directory: Path) -> dict[bool, tuple[Any, int]]:
    """The functions of ``source`` built for this CPU (the compiler's flags) in ``directory``, for an fp32 cache
    (False) and an f16 one (True): the whole step's, and the address of the one for some parts of it (which the
    kernel's helper threads share)."""
    path = compiler.build(directory, (source,), "attention")
    return {
        half: (
            compiler.load(path, attention.PAGED_HALF if half else attention.PAGED, attention.ARGUMENTS),
            int(ctypes.cast(compiler.load(path, attention.PAGED_PART_HALF if half else attention.PAGED_PART, ()),
                            ctypes.c_void_p).value or 0),
        )
        for half in (False, True)
    }  # fmt: skip


class Request:
    """One request of ``rows`` new rows over ``keys`` keys, with a cache for each of ``layers`` layers: a call
    attends it in each layer in turn. It holds the arrays whose addresses the calls take."""

    def __init__(self, functions: tuple[Any, int], share: Any, rows: int, keys: int, layers: int, half: bool) -> None:
        rng = np.random.default_rng(rows)
        self.q = rng.standard_normal((rows, HEADS * DIM)).astype(np.float32)
        kind = np.float16 if half else np.float32
        self.caches = [
            tuple(rng.standard_normal((keys, KV_HEADS * DIM)).astype(kind) for _ in "kv") for _ in range(layers)
        ]
        self.index = np.arange(keys, dtype=np.int64)
        self.cu_q, self.cu_k = np.array([0, rows], dtype=np.int32), np.array([0, keys], dtype=np.int32)
        self.out = np.empty_like(self.q)
        (self.function, self.part), self.share = functions, share

        def at(a: np.ndarray[Any, Any]) -> int:
            return int(a.ctypes.data)

        self.arguments = [
            (at(self.q), HEADS, KV_HEADS, DIM, at(k), at(v), KV_HEADS * DIM, DIM, at(self.index), at(self.cu_q),
             at(self.cu_k), 1, 512, DIM**-0.5, at(self.out))
            for k, v in self.caches
        ]  # fmt: skip

    def __call__(self) -> None:
        for each in self.arguments:
            shared = self.share(self.part, *each) if self.share else 1  # 1: not shared (too small), computed alone
            if shared != 0 and (shared != 1 or self.function(*each) != 0):
                raise RuntimeError("the attention call failed")


def timed(arms: dict[str, Request], layers: int, repeats: int) -> dict[str, list[float]]:
    """Seconds a layer's call of each arm, ``repeats`` batches of about 20 ms, the arms taking turns batch by batch."""
    samples: dict[str, list[float]] = {name: [] for name in arms}
    counts: dict[str, int] = {}
    for name, run in arms.items():
        start = time.perf_counter()
        run()
        counts[name] = max(1, int(0.02 / max(time.perf_counter() - start, 1e-6)))
    for _ in range(repeats):
        for name, run in arms.items():
            start = time.perf_counter()
            for _ in range(counts[name]):
                run()
            samples[name].append((time.perf_counter() - start) / counts[name] / layers)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,30,128", help="new rows of the request, comma-separated")
    parser.add_argument("--keys", type=int, default=1150, help="keys the last row sees (past + new rows)")
    parser.add_argument("--layers", type=int, default=30, help="caches called in turn (the bundled model's layers)")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--avx2", action="store_true", help="build without AVX-512 (-mno-avx512f)")
    parser.add_argument("--also", type=Path, help="another attention.c, timed beside the package's")
    parser.add_argument("--helpers", type=int, default=0, help="the kernel's helper threads (default 0)")
    args = parser.parse_args()
    directory = Settings().cache_dir / KERNEL_DIR
    share = None
    if args.helpers:  # the kernel's library, built before the flags below change its hash
        library = kernel.build(directory)
        kernel.start_helpers(library, args.helpers)
        share = compiler.load(library, "ttft_share_attention", (ctypes.c_void_p, *attention.ARGUMENTS))
    # An attention.c outside the package finds the package's headers.
    compiler.FLAGS = (*compiler.FLAGS, f"-I{attention.SOURCE.parent}", *(("-mno-avx512f",) if args.avx2 else ()))
    sources = {"this": attention.SOURCE, **({args.also.stem: args.also.resolve()} if args.also else {})}
    built = {name: functions(source, directory) for name, source in sources.items()}
    build = "AVX2 build (-mno-avx512f)" if args.avx2 else "native build"
    threads = f"the caller and {args.helpers} helper thread(s)" if args.helpers else "one thread"
    print(f"{HEADS} heads on {KV_HEADS} KV heads of {DIM}, {args.keys} keys, {args.layers} layers in turn, {threads}")
    print(f"{build}; least and median µs a layer over {args.repeats} batches; arms: {', '.join(sources)}")
    print(f"{'cache':5} {'rows':>4} " + " ".join(f"{name + ' least':>11} {name + ' median':>12}" for name in sources))
    for half in (False, True):
        for rows in (int(n) for n in args.rows.split(",")):
            arms = {
                name: Request(made[half], share, rows, args.keys, args.layers, half) for name, made in built.items()
            }
            samples = timed(arms, args.layers, args.repeats)
            figures = " ".join(f"{min(s) * 1e6:>11.1f} {statistics.median(s) * 1e6:>12.1f}" for s in samples.values())
            print(f"{'f16' if half else 'fp32':5} {rows:>4} {figures}", flush=True)


if __name__ == "__main__":
    main()
