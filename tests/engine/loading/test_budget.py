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
from ttft_sse.engine.kernels import kernel
from ttft_sse.engine.kernels.compiler import KERNEL_DIR
from ttft_sse.engine.loading import budget, sources

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
        weights=4 * GIB, kv_bytes_per_token=per_token, asked_tokens=8192, working=GIB, limit_mb=5 * 1024, what="m",
        kv_dtype="float16",
    )  # fmt: skip
    assert refused.refusal == (
        "m needs about 5.5 GiB (weights 4.0 GiB, working memory 1.0 GiB, a KV cache of 1024 tokens in f16 0.5 GiB) "
        "and 5.0 GiB is available (TTFT_MEMORY_LIMIT_MB); use a smaller model or quantisation, or give the server "
        "more memory (TTFT_MEMORY_LIMIT_MB, the container's limit)"
    )
    # A cache in fp32 (TTFT_KV_DTYPE=fp32): the refusal names the narrower one.
    wide = budget.plan(
        weights=4 * GIB, kv_bytes_per_token=2 * per_token, asked_tokens=8192, working=GIB, limit_mb=5 * 1024,
        what="m", kv_dtype="float32",
    )  # fmt: skip
    assert wide.refusal is not None and "a KV cache of 1024 tokens in fp32 1.0 GiB" in wide.refusal
    assert "use a smaller model or quantisation, the KV cache in f16 (TTFT_KV_DTYPE=f16), or give" in wide.refusal


REST = "beside the rest (TTFT_KV_DTYPE=auto)"
LLAMA2_7B = {
    "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 32, "vocab_size": 32000,
}  # fmt: skip


@pytest.mark.parametrize(
    ("setting", "limit_gib", "want", "reason"),
    [
        ("auto", 16, "float32", "the fp32 cache fits (TTFT_KV_DTYPE=auto)"),
        ("auto", 8, "float16", f"fp32 keys and values of 8192 tokens (8.0 GiB) do not fit in 8.0 GiB {REST}"),
        ("fp32", 8, "float32", "TTFT_KV_DTYPE=fp32"),
        ("f16", 16, "float16", "TTFT_KV_DTYPE=f16"),
    ],
    ids=["auto-fits", "auto-short", "fp32", "f16"],
)
def test_the_kv_cache_is_planned_in_the_dtype_the_setting_or_the_memory_gives(
    tmp_path: Path, setting: str, limit_gib: int, want: str, reason: str
) -> None:
    import transformers

    from ttft_sse.settings import Settings

    config = transformers.LlamaConfig(**LLAMA2_7B)  # 1 MiB a token in fp32, 0.5 MiB in f16
    settings = Settings(kv_dtype=setting, memory_limit_mb=limit_gib * 1024)
    plan, _ = budget.for_transformers(settings, "dir", str(tmp_path), None, config, "float32", on_kernel=False)
    assert (plan.kv_dtype, plan.kv_reason) == (want, reason)
    assert plan.kv_bytes_per_token == 32 * 2 * 4096 * (4 if want == "float32" else 2)
    # In f16 the whole cache asked for fits in 8 GiB beside the working memory (1.2 GiB); in fp32, 6912 tokens do.
    assert plan.kv_tokens == (6912 if setting == "fp32" else 8192)
    assert plan.as_log()["kv_dtype"] == want


def test_auto_keeps_a_large_files_kv_cache_in_f16_and_a_model_not_in_fp32_keeps_its_own(tmp_path: Path) -> None:
    from ttft_sse.errors import StartupError
    from ttft_sse.settings import Settings

    large, small = tmp_path / "large.gguf", tmp_path / "small.gguf"
    with large.open("wb") as f:
        f.truncate(budget.LARGE_FILE_BYTES)  # sparse: its size is what counts
    small.write_bytes(b"GGUF")
    auto = Settings()
    assert budget.kv_dtype(auto, str(large), "float32") == ("float16", "a 2.0 GiB file (TTFT_KV_DTYPE=auto)")
    assert budget.kv_dtype(auto, str(small), "float32") == (None, "")  # memory decides
    assert budget.kv_dtype(Settings(kv_dtype="fp32"), str(large), "float32") == ("float32", "TTFT_KV_DTYPE=fp32")
    assert budget.kv_dtype(auto, None, "bfloat16") == ("bfloat16", "the model's dtype (bfloat16)")
    with pytest.raises(StartupError, match="TTFT_KV_DTYPE=f16 is for the transformers engines on CPU in fp32"):
        budget.kv_dtype(Settings(kv_dtype="f16"), None, "bfloat16")


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
    from ttft_sse.engine.kernels.stored import HEADER_FILE, table

    path = sources.bundled_gguf()
    size = path.stat().st_size
    # The table the engines keep in the suite's cache (parsing the file again takes seconds: its vocabulary).
    tensors = table(path, sources.model_dir(path, CACHE_DIR) / HEADER_FILE)
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
