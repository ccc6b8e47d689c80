#!/usr/bin/env bash
# ttft-sse against llama.cpp's llama-server, the same GGUF on the same machine, one server loaded at a time.
#
#   benchmarks/against_llama_server.sh [ARM...]      # default arms: ours llama-t2 llama-t1 ours
#
# "ours" is a ttft-sse server already running at OURS_URL (default http://127.0.0.1:8102, e.g. `ttft-sse serve
# --port 8102 --threads 1`), "ours@PORT" one on 127.0.0.1:PORT (another setting side by side); "llama-tN" starts
# llama-server with N threads and 8 slots on LLAMA_PORT (default 8104) for its run and stops it (by its PID) after.
# Each arm gets `ttft-sse bench` at c=1 and c=8 (the closed loop: one server loaded at a time), new conversations of
# 32-96 tokens from benchmarks/chat-questions.txt; the tables go to stdout, results.json under OUT (default
# .cache/against-llama-server).
#
# The first run builds llama-server (minutes) from the llama.cpp tree that llama-cpp-python's source distribution on
# PyPI carries, into LLAMA_DIR, for the vector extensions this CPU's flags list (a build dir for each set): no
# llama-server package or hub download is needed. GGML_NATIVE is off and AMX is not asked for: ggml-cpu's AMX tile
# code crashes (general protection fault at ldtilecfg) on a VM that does not let processes use the tiles.
#
# Other GGUF files and model families, each against llama-server with both servers started by the script:
# benchmarks/against_llama_server.py.
set -euo pipefail
cd "$(dirname "$0")/.."
OURS_URL=${OURS_URL:-http://127.0.0.1:8102}
LLAMA_PORT=${LLAMA_PORT:-8104}
LLAMA_DIR=${LLAMA_DIR:-.cache/llama-server}
LLAMA_CPP_PYTHON=${LLAMA_CPP_PYTHON:-0.3.36}
OUT=${OUT:-.cache/against-llama-server}
REQUESTS=${REQUESTS:-64}
PY=${PY:-.venv/bin/python}
GGUF=$("$PY" -c 'from ttft_sse.engine.loading.sources import bundled_gguf; print(bundled_gguf())')
flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
isa=(-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON)
for f in avx512f:AVX512 avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
    [[ $flags == *" ${f%%:*} "* ]] && isa+=("-DGGML_${f#*:}=ON")
done
build=build-$(echo "${isa[*]}" | md5sum | cut -c1-8)
BIN=$LLAMA_DIR/llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp/$build/bin/llama-server

if [[ ! -x $BIN ]]; then
    mkdir -p "$LLAMA_DIR"
    src=$LLAMA_DIR/llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp
    if [[ ! -d $src ]]; then
        "$PY" -m pip download --quiet --no-deps --no-binary :all: -d "$LLAMA_DIR" "llama-cpp-python==$LLAMA_CPP_PYTHON"
        tar xzf "$LLAMA_DIR/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz" -C "$LLAMA_DIR"
    fi
    cmake -S "$src" -B "$src/$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=OFF "${isa[@]}" >/dev/null
    cmake --build "$src/$build" --target llama-server -j "$(nproc)" >/dev/null
fi

# benchmarks/against_llama_server.py asks for the binary this way (building it on the first run).
if [[ ${1:-} == --print-server ]]; then echo "$BIN"; exit 0; fi

mkdir -p "$OUT"
arms=("$@")
[[ ${#arms[@]} -gt 0 ]] || arms=(ours llama-t2 llama-t1 ours)
run=0
for arm in "${arms[@]}"; do
    run=$((run + 1))
    url=$OURS_URL pid=
    [[ $arm == ours@* ]] && url=http://127.0.0.1:${arm#ours@}
    if [[ $arm == llama-t* ]]; then
        url=http://127.0.0.1:$LLAMA_PORT
        "$BIN" -m "$GGUF" --host 127.0.0.1 --port "$LLAMA_PORT" -t "${arm#llama-t}" -np 8 -c 8192 \
            >"$OUT/$run-$arm.log" 2>&1 &
        pid=$!
        for _ in $(seq 120); do curl -sf "$url/health" >/dev/null && break; sleep 0.5; done
    fi
    echo "=== run $run: $arm ($url), load average $(cut -d' ' -f1-3 /proc/loadavg)"
    "$PY" -m ttft_sse bench --url "$url" --protocol openai --concurrency 1,8 --requests "$REQUESTS" \
        --prompts benchmarks/chat-questions.txt --max-tokens 32-96 --mode stream --no-charts \
        --out "$OUT/$run-$arm" 2>/dev/null | grep -v '^wrote'
    if [[ -n $pid ]]; then kill "$pid"; wait "$pid" 2>/dev/null || true; fi
done

# The c=8 TTFT of the steady state too: the bench's own p99 holds each run's first 8 requests, sent at once.
"$PY" - "$OUT" "$run" "${arms[@]}" <<'PY'
import json, sys
from ttft_sse.bench.stats import percentile

out, runs, arms = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
print("\n| run | c=1 tok/s | c=1 TTFT p50 | c=8 tok/s | c=8/c=1 | c=8 TTFT p50 / p99, steady | steady p99 / c=1 p50 |")
print("|---|---|---|---|---|---|---|")
for run, arm in enumerate(arms, start=1):
    doc = json.load(open(f"{out}/{run}-{arm}/results.json"))
    rate = {row["concurrency"]: row["tokens_per_s"] for row in doc["summary"]}
    ok = [r for r in sorted(doc["records"], key=lambda r: r["start_s"]) if r["outcome"] == "ok"]
    c1 = percentile([r["ttft_ms"] for r in ok if r["concurrency"] == 1], 50)
    steady = [r["ttft_ms"] for r in ok if r["concurrency"] == 8][8:]
    p50, p99 = percentile(steady, 50), percentile(steady, 99)
    print(f"| {run} {arm} | {rate[1]:.1f} | {c1:.1f} | {rate[8]:.1f} | {rate[8] / rate[1]:.2f}x | {p50:.0f} / {p99:.0f} | {p99 / c1:.2f}x |")
PY
