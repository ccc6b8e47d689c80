"""Memory planned before a model loads: its weights, its KV cache and the working memory, against what there is.

A model that does not fit must be refused at start with the numbers, never found out by the kernel's OOM killer
half-way through its load. :func:`plan` estimates, from the model's config and its file(s) alone (nothing is read
but headers):

- the weights as the engine will hold them: on CPU in fp32 a GGUF's matrices in the block kernel's layouts (about
  their size in the file: :data:`LAYOUT_FACTOR`), the token embedding's rows read from the file, anything else in
  fp32; llama.cpp maps the file as it is; a model directory's files widened to the dtype it runs in;
- the KV cache for ``kv_cache_tokens`` (every layer's keys and values: on the transformers engines in fp32 or f16 as
  ``TTFT_KV_DTYPE`` says, :func:`kv_dtype`; f16 on llama.cpp's, as it keeps them by default);
- the working memory: the runtime (torch, transformers, the server: :data:`RUNTIME_BYTES`) and a step's activations
  and logits for ``batch_tokens`` tokens;

against what the process may use (:func:`available`): ``TTFT_MEMORY_LIMIT_MB`` where set, else the machine's
``MemAvailable`` plus what the process holds already, at most its cgroup's ``memory.max`` less what the group uses
besides. Where the KV cache does not fit beside the rest it is made smaller (:attr:`Plan.kv_tokens`, logged), down
to :data:`LEAST_KV_TOKENS`; below that, or where the weights alone do not fit, :class:`Plan.refusal` says why in one
sentence with the numbers, and the server does not start.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from ttft_sse.engine.kernels.codes import DENSE, FORMATS
from ttft_sse.errors import StartupError

log = structlog.get_logger("ttft_sse.engine")

MIB = 2**20
GIB = 2**30
RUNTIME_BYTES = 1024 * MIB
"""The process with a small model loaded, less its weights and KV cache: torch, transformers and their imports, the
server, the kernels' libraries and buffers (the bundled model's server holds ~1.4 GB with 0.1 GB of weights and 0.36
GB of KV cache)."""
LEAST_KV_TOKENS = 1024
"""The smallest KV cache a plan gives: fewer tokens than this would serve too few requests to be worth starting."""
LAYOUT_FACTOR = {"Q5_0": 1.6, "Q5_1": 1.45, "Q5_K": 1.8, "Q6_K": 1.25}
"""The block kernel's layout of a matrix against its bytes in the file, at most (codes held in 8 bits where the CPU's
build does not take 5 or 6: engine/kernels/layouts.py); 1.05 for the other types."""
INT8_FACTOR = 1.6
"""The int8 rows' records against the file's bytes, at most (fp32 scales and offsets beside the codes: a 7B Q4_K_M
file of 3.9 GiB is 5.3 GiB of records)."""
CGROUP = Path("/sys/fs/cgroup")
"""cgroup v2's files of this process's group (a container's memory limit)."""
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
LARGE_FILE_BYTES = 2 * GIB
"""From this size of GGUF file up, ``TTFT_GGUF_ACTIVATIONS=auto`` gives the block kernel int8 rows
(engine/loading/model.py) and ``TTFT_KV_DTYPE=auto`` keeps the KV cache in f16 (:func:`kv_dtype`)."""
KV_DTYPES = {"fp32": "float32", "f16": "float16"}
"""``TTFT_KV_DTYPE``'s values and the torch dtypes they name."""


@dataclass(frozen=True)
class Plan:
    """What a model will hold, in bytes, and what the process may use."""

    weights: int
    kv_bytes_per_token: int
    kv_tokens: int  # the KV cache's tokens: the setting's, or fewer where that does not fit
    asked_tokens: int
    working: int
    available: int
    limit_from: str  # where ``available`` comes from
    refusal: str | None = None  # the sentence a refused start prints
    kv_dtype: str = "float32"  # the KV cache's values (``float32``, ``float16``, or the model's dtype)
    kv_reason: str = ""  # why that dtype (TTFT_KV_DTYPE's value, or auto's reason)

    @property
    def kv_cache(self) -> int:
        return self.kv_bytes_per_token * self.kv_tokens

    def as_log(self) -> dict[str, Any]:
        return {
            "weights_mib": round(self.weights / MIB),
            "kv_cache_mib": round(self.kv_cache / MIB),
            "kv_tokens": self.kv_tokens,
            "kv_dtype": self.kv_dtype,
            "kv_dtype_reason": self.kv_reason,
            "working_mib": round(self.working / MIB),
            "available_mib": round(self.available / MIB),
            "limit_from": self.limit_from,
        }


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def available(limit_mb: int, cgroup: Path = CGROUP) -> tuple[int, str]:
    """The bytes the process may use, and where that figure comes from (the module docstring)."""
    if limit_mb > 0:
        return limit_mb * MIB, "TTFT_MEMORY_LIMIT_MB"
    held = resident_bytes()
    have, source = held + _meminfo("MemAvailable"), "MemAvailable"
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            used = int((cgroup / "memory.current").read_text().strip())
            headroom = int(limit) - used + held
            if headroom < have:
                have, source = headroom, f"cgroup memory.max ({_gib(int(limit))})"
    except (OSError, ValueError):
        pass  # no cgroup v2 memory controller to read
    return max(have, 0), source


def _meminfo(key: str) -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name == key:
                return int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")) if hasattr(os, "sysconf") else 0


def resident_bytes() -> int:
    """The process's resident memory now."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def peak_resident_bytes() -> int:
    """The most the process has held resident so far: its memory map's high-water mark (``VmHWM``), which starts
    anew with the program. Not ``ru_maxrss``: Linux carries that over from before ``exec``, so a process forked from a
    large one starts with its parent's peak. ``ru_maxrss`` only where /proc cannot be read."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _config_value(config: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def kv_bytes_per_token(config: Any, element_bytes: int) -> int:
    """One token's keys and values in every layer, at ``element_bytes`` a value."""
    layers = int(_config_value(config, "num_hidden_layers", default=1))
    heads = int(_config_value(config, "num_attention_heads", default=1))
    kv_heads = int(_config_value(config, "num_key_value_heads", default=heads))
    hidden = int(_config_value(config, "hidden_size", default=0))
    head = int(_config_value(config, "head_dim", default=hidden // max(heads, 1)))
    return layers * 2 * kv_heads * head * element_bytes


def working_bytes(config: Any, batch_tokens: int) -> int:
    """The runtime and one step's activations and logits for ``batch_tokens`` tokens (fp32)."""
    hidden = int(_config_value(config, "hidden_size", default=0))
    ffn = int(_config_value(config, "intermediate_size", default=4 * hidden))
    vocab = int(_config_value(config, "vocab_size", default=0))
    return RUNTIME_BYTES + batch_tokens * (6 * hidden + 3 * ffn + vocab) * 4


def gguf_weights(
    tensors: dict[str, Any], *, on_kernel: bool, int8: bool = False, embedding: str = "token_embd.weight"
) -> int:
    """The weights of a GGUF file's ``tensors`` (engine/kernels/stored.py's table) as the transformers engines hold them
    on CPU in fp32: with ``on_kernel``, matrices of the kernel's types laid out for it (as int8 rows' records where
    ``int8``), the embedding's rows read from the file (its bytes, at most), the rest in fp32."""

    def laid(tensor: Any) -> int:
        return int(tensor.size * (INT8_FACTOR if int8 else LAYOUT_FACTOR.get(tensor.kind_name, 1.05)))

    total = 0
    tied = "output.weight" not in tensors
    for name, tensor in tensors.items():
        values = 1
        for n in tensor.shape:
            values *= int(n)
        kernel_type = tensor.kind in FORMATS or tensor.kind in DENSE
        if not on_kernel or not kernel_type or len(tensor.shape) != 2 or tensor.shape[1] % 32:
            total += values * 4
        elif name == embedding:
            total += tensor.size  # rows read from the file: resident as they are touched
            if tied:  # the LM head lays the same codes out for the kernel
                total += laid(tensor)
        else:
            total += laid(tensor)
    return total


def directory_weights(location: Path, config: Any, dtype: str) -> tuple[int, str | None]:
    """A model directory's weights in ``dtype`` (the files' bytes, widened from the config's dtype), and a sentence
    where they are widened (None where not)."""
    files = [*location.glob("*.safetensors"), *location.glob("*.bin")]
    stored = sum(f.stat().st_size for f in files)
    saved = str(_config_value(config, "dtype", "torch_dtype", default="float32")).removeprefix("torch.")
    ratio = DTYPE_BYTES.get(dtype, 4) / DTYPE_BYTES.get(saved, 4)
    if ratio > 1:
        return int(
            stored * ratio
        ), f"its {saved} weights ({_gib(stored)}) are widened to {dtype} ({_gib(stored * ratio)})"
    return stored, None


def plan(
    *,
    weights: int,
    kv_bytes_per_token: int,
    asked_tokens: int,
    working: int,
    limit_mb: int,
    what: str,
    cgroup: Path = CGROUP,
    kv_dtype: str = "float32",
    kv_reason: str = "",
) -> Plan:
    """The plan for ``what`` (the model and engine, as the refusal names them): the KV cache (of ``kv_dtype``
    values, for ``kv_reason``) made smaller where it does not fit, or a refusal (the module docstring)."""
    have, source = available(limit_mb, cgroup)
    room = have - weights - working
    tokens = asked_tokens
    if room < kv_bytes_per_token * asked_tokens:
        tokens = max(0, room // max(kv_bytes_per_token, 1)) // 256 * 256
    refusal = None
    if tokens < min(LEAST_KV_TOKENS, asked_tokens):
        least = min(LEAST_KV_TOKENS, asked_tokens)
        need = weights + working + kv_bytes_per_token * least
        named = {"float32": "fp32", "float16": "f16"}.get(kv_dtype, kv_dtype)
        narrower = ", the KV cache in f16 (TTFT_KV_DTYPE=f16)" if kv_dtype == "float32" else ""
        refusal = (
            f"{what} needs about {_gib(need)} (weights {_gib(weights)}, working memory {_gib(working)}, a KV cache "
            f"of {least} tokens in {named} {_gib(kv_bytes_per_token * least)}) and {_gib(have)} is available "
            f"({source}); use a smaller model or quantisation{narrower}, or give the server more memory "
            "(TTFT_MEMORY_LIMIT_MB, the container's limit)"
        )
        tokens = least
    return Plan(weights, kv_bytes_per_token, tokens, asked_tokens, working, have, source, refusal, kv_dtype, kv_reason)


def kv_dtype(settings: Any, gguf: str | None, dtype: str) -> tuple[str | None, str]:
    """The transformers engines' KV cache dtype for a model that computes in ``dtype`` on CPU (``gguf``: its file,
    None for a directory or id), and why: ``TTFT_KV_DTYPE`` where set (``fp32`` or ``f16``); for ``auto`` f16 for a
    GGUF file of :data:`LARGE_FILE_BYTES` or more, and None where memory decides (:func:`for_transformers`: f16
    where the fp32 cache would not fit whole). A model that does not compute in fp32 keeps its KV cache in its own
    dtype; a setting other than ``auto`` for it is refused (:class:`StartupError`)."""
    if dtype != "float32":
        if settings.kv_dtype != "auto":
            raise StartupError(
                f"TTFT_KV_DTYPE={settings.kv_dtype} is for the transformers engines on CPU in fp32; this model runs "
                f"in {dtype}, and its KV cache is in {dtype}: unset TTFT_KV_DTYPE (or set it to auto)"
            )
        return dtype, f"the model's dtype ({dtype})"
    if settings.kv_dtype != "auto":
        return KV_DTYPES[settings.kv_dtype], f"TTFT_KV_DTYPE={settings.kv_dtype}"
    if gguf is not None and (size := Path(gguf).stat().st_size) >= LARGE_FILE_BYTES:
        return "float16", f"a {_gib(size)} file (TTFT_KV_DTYPE=auto)"
    return None, ""


def for_transformers(
    settings: Any,
    kind: str,
    location: str,
    gguf: str | None,
    config: Any,
    dtype: str,
    on_kernel: bool,
    int8: bool = False,
) -> tuple[Plan, str | None]:
    """The plan of a transformers engine on CPU for a model whose config is ``config`` (``kind``: ``"gguf"``, with
    the file ``gguf``, or a directory or id at ``location``; ``int8``: the block kernel on int8 rows); and a sentence
    where a directory's weights are widened."""
    from ttft_sse.engine.kernels.stored import HEADER_FILE, table

    chosen, reason = kv_dtype(settings, gguf, dtype)
    widened = None
    if kind == "gguf" and gguf is not None:
        weights = gguf_weights(table(gguf, Path(location) / HEADER_FILE), on_kernel=on_kernel, int8=int8)
    elif Path(location).is_dir():
        weights, widened = directory_weights(Path(location), config, dtype)
    else:
        weights = 0  # a model id: what the hub's files hold is not known before they are read

    def planned(kv: str, why: str) -> Plan:
        return plan(
            weights=weights,
            kv_bytes_per_token=kv_bytes_per_token(config, DTYPE_BYTES.get(kv, 4)),
            asked_tokens=settings.kv_cache_tokens,
            working=working_bytes(config, settings.batch_tokens),
            limit_mb=settings.memory_limit_mb,
            what=f"the model {Path(gguf or location).name}",
            kv_dtype=kv,
            kv_reason=why,
        )

    if chosen is not None:
        return planned(chosen, reason), widened
    whole = planned("float32", "the fp32 cache fits (TTFT_KV_DTYPE=auto)")
    if whole.kv_tokens >= whole.asked_tokens and whole.refusal is None:
        return whole, widened
    short = (
        f"fp32 keys and values of {whole.asked_tokens} tokens ({_gib(whole.kv_bytes_per_token * whole.asked_tokens)})"
        f" do not fit in {_gib(whole.available)} beside the rest (TTFT_KV_DTYPE=auto)"
    )
    return planned("float16", short), widened


def for_llama_cpp(settings: Any, gguf: str, config: Any) -> Plan:
    """The plan of the llama.cpp engine: the file mapped as it is, an f16 KV cache, its compute buffers."""
    return plan(
        weights=Path(gguf).stat().st_size,
        kv_bytes_per_token=kv_bytes_per_token(config, 2),
        asked_tokens=settings.kv_cache_tokens,
        working=working_bytes(config, min(settings.batch_tokens, 512)),
        limit_mb=settings.memory_limit_mb,
        what=f"the model {Path(gguf).name} on llama.cpp",
        kv_dtype="float16",
        kv_reason="llama.cpp's own (TTFT_KV_DTYPE is the transformers engines')",
    )


def settle(plan: Plan) -> Plan:
    """``plan`` logged (``memory_planned``, and ``kv_cache_sized`` where the KV cache was made smaller); a refusal is
    logged and raised as :class:`StartupError` with its sentence, which the server prints before it exits."""
    if plan.refusal is not None:
        log.error("memory_refused", **plan.as_log())
        raise StartupError(plan.refusal)
    log.info("memory_planned", **plan.as_log())
    if plan.kv_tokens < plan.asked_tokens:
        log.warning("kv_cache_sized", asked=plan.asked_tokens, tokens=plan.kv_tokens, reason="memory")
    return plan
