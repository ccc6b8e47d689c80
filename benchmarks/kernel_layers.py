"""The block kernel alone (engine/kernel.c), before and after a change, on the bundled model's layer shapes.

    python benchmarks/kernel_layers.py --before DIR            # DIR: kernel.c, decoder.c and kernel.h of before
    python benchmarks/kernel_layers.py --before DIR --helpers 0 --rounds 8

``git show HEAD~1:ttft_sse/engine/kernel.c > DIR/kernel.c`` (and the other two) makes DIR. Each side is a small C
program that includes its kernel.c and times ``ttft_blocks_linear`` on random codes of the shapes of SmolLM2-135M:
q and o (576 x 576), k and v (576 x 192), gate and up (576 x 1536), down (1536 x 576) with 4-bit codes, and the
output layer (576 x 49152) with 8-bit codes, as the bundled GGUF holds them. Rows: a decode step of 1 or 8 streams
and prompts of 16-60 new tokens. The two programs run one after the other, the order swapped every round; the
table shows each side's best time (µs a call) and before / after. A whole pass sums the 210 layers of 30 decoder
layers with the output layer: every row's for 1 and 8 rows (a decode step), the last row's for 16 and more (a
prompt). Every output's bits are hashed: ``same`` means both sides gave the same bits for
every call.

No engine, no Python in the timed loop: this times what a change of the kernel does to the kernel, on the machine
as it is (shared machines vary from run to run; compare the two columns of one run).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ttft_sse.engine import kernel

SHAPES = {  # name: (K, N, bits, times in a pass)
    "q/o": (576, 576, 4, 60),
    "k/v": (576, 192, 4, 60),
    "gate/up": (576, 1536, 4, 60),
    "down": (1536, 576, 4, 30),
    "output": (576, 49152, 8, 1),
}
ROWS = (1, 8, 16, 24, 37, 60)

HARNESS = r"""
#include "%(kernel)s"
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    int helpers = atoi(argv[1]);
    if (helpers > 0) ttft_helper_start(helpers);
    for (int a = 2; a + 4 < argc; a += 5) {
        const char *name = argv[a];
        int64_t K = atoll(argv[a + 1]), N = atoll(argv[a + 2]);
        int bits = atoi(argv[a + 3]), M = atoi(argv[a + 4]);
        int64_t panels = (N + P - 1) / P, blocks = K / BLOCK, bytes = panels * K * P * bits / 8;
        uint8_t *codes = malloc(bytes);
        float *scale = malloc(sizeof(float) * panels * blocks * P), *zero = malloc(sizeof(float) * panels * blocks * P);
        float *x = malloc(sizeof(float) * M * K), *y = malloc(sizeof(float) * M * N);
        srand(1);
        for (int64_t i = 0; i < bytes; i++) codes[i] = (uint8_t)rand();
        for (int64_t i = 0; i < panels * blocks * P; i++) {
            scale[i] = 0.001f * (rand() %% 100 + 1);
            zero[i] = bits == 4 ? -0.0005f * (rand() %% 100) : 0.0f;
        }
        for (int64_t i = 0; i < M * K; i++) x[i] = 0.001f * (rand() %% 2001 - 1000);
        int calls = (int)(2e8 / (double)(M * K * N)) + 5;
        for (int i = 0; i < 3; i++) ttft_blocks_linear(x, M, K, codes, bits, scale, zero, N, y);
        double best = 1e30;
        for (int r = 0; r < 5; r++) {
            double t = now();
            for (int i = 0; i < calls; i++) ttft_blocks_linear(x, M, K, codes, bits, scale, zero, N, y);
            double each = (now() - t) / calls;
            if (each < best) best = each;
        }
        unsigned long long hash = 1469598103934665603ULL;
        for (int64_t i = 0; i < M * N; i++) {
            uint32_t u;
            memcpy(&u, &y[i], 4);
            hash = (hash ^ u) * 1099511628211ULL;
        }
        printf("%%s %%d %%.3f %%016llx\n", name, M, best * 1e6, hash);
        free(codes), free(scale), free(zero), free(x), free(y);
    }
    return 0;
}
"""


def kernel_files(directory: Path) -> tuple[Path, ...]:
    """``directory``'s copies of the block kernel's sources (kernel.py's ``SOURCES``: kernel.c, decoder.c); exits
    naming any of them, or of the headers they include, that is not there."""
    sources = tuple(directory / source.name for source in kernel.SOURCES)
    missing = [str(path) for path in (*sources, *(directory / h.name for h in kernel.HEADERS)) if not path.is_file()]
    if missing:
        raise SystemExit(f"missing {', '.join(missing)}")
    return sources


def compile_side(directory: Path, into: Path, label: str) -> Path:
    source = into / f"{label}.c"
    kernel_files(directory)
    source.write_text(HARNESS % {"kernel": (directory / kernel.SOURCE.name).resolve()})
    program = into / label
    flags = [flag for flag in kernel.FLAGS if flag not in ("-shared", "-fPIC", "-std=c11")]
    try:
        compiler = kernel.c_compiler()
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from None
    subprocess.run([compiler, *flags, "-std=gnu11", "-o", str(program), str(source), "-lpthread"], check=True)
    return program


def whole_pass(best: dict[tuple[str, str, int], float], side: str, rows: int) -> float:
    """ms of a forward pass of ``rows`` rows: a decode step of that many streams up to 8 rows (each row through the
    output layer), a prompt's prefill from 16 (only its last row through the output layer)."""
    total = 0.0
    for name, (*_, times) in SHAPES.items():
        total += best[side, name, rows if name != "output" or rows <= 8 else 1] * times
    return total / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="kernel.c, decoder.c and kernel.h of before")
    parser.add_argument("--after", type=Path, default=kernel.SOURCE.parent, help="default: this package's")
    parser.add_argument("--helpers", type=int, default=1, help="the kernel's helper threads (the engine's default: 1)")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    jobs = [str(part) for name, (k, n, bits, _) in SHAPES.items() for m in ROWS for part in (name, k, n, bits, m)]
    best: dict[tuple[str, str, int], float] = defaultdict(lambda: float("inf"))
    hashes: dict[tuple[str, int], set[str]] = defaultdict(set)
    with tempfile.TemporaryDirectory() as scratch:
        sides = {
            "before": compile_side(args.before, Path(scratch), "before"),
            "after": compile_side(args.after, Path(scratch), "after"),
        }
        for round_ in range(args.rounds):
            for side in ("before", "after") if round_ % 2 == 0 else ("after", "before"):
                out = subprocess.run(
                    [str(sides[side]), str(args.helpers), *jobs], capture_output=True, text=True, check=True
                ).stdout
                for line in out.splitlines():
                    name, m, micro, bits = line.split()
                    best[side, name, int(m)] = min(best[side, name, int(m)], float(micro))
                    hashes[name, int(m)].add(bits)
            print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print(f"{args.rounds} rounds, helpers={args.helpers}; µs a call, best of the rounds (5 timings each)")
    print()
    print("| layer | rows | before | after | before / after | bits |")
    print("|---|---|---|---|---|---|")
    for name in SHAPES:
        for m in ROWS:
            before, after = best["before", name, m], best["after", name, m]
            same = "same" if len(hashes[name, m]) == 1 else "DIFFERENT"
            print(f"| {name} | {m} | {before:.1f} | {after:.1f} | {before / after:.2f}x | {same} |")
    print()
    print("| whole pass (210 layers + output) | rows | before ms | after ms | before / after |")
    print("|---|---|---|---|---|")
    for m in ROWS:
        passes = {side: whole_pass(best, side, m) for side in ("before", "after")}
        print(f"| | {m} | {passes['before']:.2f} | {passes['after']:.2f} | {passes['before'] / passes['after']:.2f}x |")


if __name__ == "__main__":
    main()
