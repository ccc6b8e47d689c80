"""Memory planned before a model loads (engine/loading/budget.py), and what a GGUF's load holds, in a new process."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_cli import serve
from tests.support import ggufs
from tests.support.paths import CACHE_DIR
from tests.support.processes import ROOT
from tests.support.servers import free_port
from ttft_sse.engine.cpu import kernel
from ttft_sse.engine.loading import budget, sources
from ttft_sse.engine.loading.model import KERNEL_DIR

MIB = budget.MIB
GIB = budget.GIB


def test_a_kv_cache_that_does_not_fit_is_made_smaller_and_a_model_that_does_not_is_refused(tmp_path: Path) -> None:
    per_token = 512 * 1024  # a 7B MHA model's in f16: 32 layers x 2 x 4096 x 2 bytes
    fits = budget.plan(
        weights=4 * GIB, kv_bytes_per_token=per_token, asked_tokens=8192, working=GIB, limit_mb=12 * 1024, what="m"
    )
    assert (fits.kv_tokens, fits.refusal, fits.limit_from) == (8192, None, "TTFT_MEMORY_LIMIT_MB")
    assert fits.kv_cache == 4 * GIB
    smaller = budget.plan(
        weights=4 * GIB, kv_bytes_per_token=per_token, asked_tokens=8192, working=GIB, limit_mb=8 * 1024, what="m"
    )
    assert (smaller.kv_tokens, smaller.refusal) == (6144, None)  # 3 GiB left, in whole 256-token steps
    refused = budget.plan(
        weights=4 * GIB, kv_bytes_per_token=per_token, asked_tokens=8192, working=GIB, limit_mb=5 * 1024, what="m"
    )
    assert refused.refusal == (
        "m needs about 5.5 GiB (weights 4.0 GiB, working memory 1.0 GiB, a KV cache of 1024 tokens 0.5 GiB) and "
        "5.0 GiB is available (TTFT_MEMORY_LIMIT_MB); use a smaller model or quantisation, or give the server more "
        "memory (TTFT_MEMORY_LIMIT_MB, the container's limit)"
    )


def test_a_cgroup_limit_below_what_the_machine_has_is_the_one_planned_for(tmp_path: Path) -> None:
    (tmp_path / "memory.max").write_text(f"{2 * GIB}\n")
    (tmp_path / "memory.current").write_text(f"{GIB}\n")
    have, source = budget.available(0, cgroup=tmp_path)
    assert source == "cgroup memory.max (2.0 GiB)"
    assert have == GIB + budget.resident_bytes() or abs(have - GIB - budget.resident_bytes()) < 64 * MIB
    (tmp_path / "memory.max").write_text("max\n")
    have, source = budget.available(0, cgroup=tmp_path)
    assert source == "MemAvailable" and have > 0


def test_a_gguf_s_weights_are_planned_at_about_its_size_on_the_kernel_and_at_four_bytes_a_weight_without() -> None:
    from ttft_sse.engine.cpu.stored import table

    path = sources.bundled_gguf()
    size = path.stat().st_size
    tensors = table(path)
    on_kernel = budget.gguf_weights(tensors, on_kernel=True)
    assert size < on_kernel < 1.4 * size  # the layouts, the embedding's rows, the tied head's own codes
    values = sum(math.prod(t.shape) for t in tensors.values())
    assert budget.gguf_weights(tensors, on_kernel=False) == 4 * values


ALLOWANCE = 384 * MIB
"""What a load holds beside the weights, and does not grow with them: the tokenizer, the file's metadata as gguf's
reader parses it (~180 MB at their peak, before any weight is read), the kernels' libraries and buffers; on a first
start, one layer's codes while it is laid out (~140 MB for this model's LM head). Seen: 420-500 MB added in all on a
first start of this 205 MB file, 280 MB on a later one."""

LOAD = """
import json, sys
from pathlib import Path
import torch, transformers, transformers.modeling_utils  # the runtime, before the model
from ttft_sse.engine.loading import budget
base = budget.resident_bytes()
from ttft_sse.engine.single import SingleEngine
from ttft_sse.settings import Settings
from ttft_sse.stages import StageClock
engine = SingleEngine(Settings(model=sys.argv[1], cache_dir=Path(sys.argv[2]), threads=1, prefill_process=False))
engine.load(StageClock())
peak = budget.peak_resident_bytes()
print(json.dumps({"base": base, "peak": peak, "weights": engine.info.weights_bytes, "layout": engine.info.weights}))
"""


@pytest.fixture(scope="module")
def quarter_gb_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama of ~330M parameters in the Q4_K_M mix (random blocks), ~200 MB: a file whose fp32 expansion (1.3 GB)
    would dwarf it."""
    root = tmp_path_factory.mktemp("memory")
    return ggufs.write_llama(
        root / "quarter.gguf",
        tokenizer_from=sources.bundled_gguf(),
        hidden=1024,
        layers=20,
        heads=16,
        kv_heads=4,
        ffn=2816,
        seed=3,
    )


def load_in_a_new_process(model: Path, cache: Path) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", LOAD, str(model), str(cache)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TTFT_LOG_FORMAT": "json"},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["layout"] == "gguf-blocks", done.stderr[-3000:]  # every layer on the kernel, none expanded
    return result


def test_a_k_quant_gguf_loads_in_about_its_file_s_memory_and_leaves_no_fp32_copy(
    quarter_gb_model: Path, tmp_path: Path
) -> None:
    """The first start (codes read and laid out) and a later one (the laid-out arrays mapped): what the load adds to
    the imported runtime stays under the file's size and a quarter (the kernel's layouts) plus :data:`ALLOWANCE`;
    the fp32 copy this file once became would add 1.3 GB, six times the file. The model's cache folder holds its
    metadata and the laid-out arrays: no fp32 copy, at most 1.2 times the file."""
    size = quarter_gb_model.stat().st_size
    kernel.build(CACHE_DIR / KERNEL_DIR)  # built once for the whole run (here, if another test left none)
    (tmp_path / KERNEL_DIR).symlink_to(CACHE_DIR / KERNEL_DIR)
    for start in ("first", "later"):
        got = load_in_a_new_process(quarter_gb_model, tmp_path)
        added = got["peak"] - got["base"]
        assert added < 1.25 * size + ALLOWANCE, (start, added / MIB, size / MIB)
        assert size * 0.9 < got["weights"] < 1.25 * size, (start, got["weights"] / MIB)
    folder = sources.model_dir(quarter_gb_model, tmp_path)
    kept = {f.name: f.stat().st_size for f in folder.iterdir()}
    assert not [name for name in kept if name.endswith((".safetensors", ".bin.partial", ".npz"))]
    assert sum(kept.values()) < 1.2 * size, kept


def test_a_start_that_cannot_fit_is_refused_with_the_numbers_and_no_traceback(tmp_path: Path) -> None:
    model = ggufs.write_llama(tmp_path / "tiny.gguf", tokenizer_from=sources.bundled_gguf(), seed=7)
    proc = serve("--port", str(free_port()), "--model", str(model), env={"TTFT_MEMORY_LIMIT_MB": "600"})
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1
    assert "Traceback" not in out
    refusal = [line for line in out.splitlines() if line.startswith("ttft-sse: ")]
    assert len(refusal) == 1 and "needs about 1.1 GiB" in refusal[0] and "0.6 GiB is available" in refusal[0]
