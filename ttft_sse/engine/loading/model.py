"""Loading a model: weights found (engine/loading/sources.py), tokenizer and model read by transformers, the weights
laid out for the CPU kernels, and what the engines need to know of the result.

Torch and transformers are imported here, inside :func:`load_model`, so that importing an engine costs nothing and
the ``imports`` stage of a cold start is timed: transformers' own modelling machinery too, which it would otherwise
import lazily inside the ``tokenizer`` stage (its config lookup) and make that stage look seconds long.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from ttft_sse.engine.base import INT8, NORMAL, ModelInfo
from ttft_sse.engine.kernels import attention, kernel, weights
from ttft_sse.engine.kernels.compiler import KERNEL_DIR
from ttft_sse.engine.library import decoder, families, grouped, half_cache
from ttft_sse.engine.loading import assembly, budget, imports, sources
from ttft_sse.errors import StartupError
from ttft_sse.settings import Settings
from ttft_sse.stages import StageClock

log = structlog.get_logger("ttft_sse.engine")

GPU_NODES = ("/dev/nvidiactl", "/dev/kfd")
"""Device files of a machine where torch may see a GPU (NVIDIA's driver, ROCm's)."""


@dataclass(frozen=True)
class Loaded:
    """A model ready to run: its tokenizer, its end-of-sequence ids, what ``/readyz`` says of it, and the block
    kernel's library where the kernel serves its layers (None elsewhere)."""

    torch: Any
    tokenizer: Any
    model: Any
    eos: frozenset[int]
    info: ModelInfo
    library: Path | None


def load_model(settings: Settings, clock: StageClock) -> Loaded:
    """Load ``settings.model`` on ``settings.device`` in ``settings.dtype``, timing each stage on ``clock``: a GGUF
    file from the file itself (:func:`_from_gguf`), a model directory or id through transformers."""
    source = sources.resolve(settings.model)
    early = start_builds(settings, source)  # beside the imports; else once the device is known, beside the conversion
    with clock.stage("imports"), _imports_uncollected():
        import torch
        import transformers

        # What every model's loading and modules import (torch._dynamo, torch.distributed.tensor, accelerate): seconds,
        # which transformers imports lazily, inside whichever stage touches it first; here it is counted as imports.
        # The models' table from the cache directory: 0.26 s less a start (engine/loading/imports.py).
        with imports.remembered_models_table(settings.cache_dir):
            import transformers.activations
            import transformers.masking_utils
            import transformers.modeling_utils
    threads = settings.torch_threads
    torch.set_num_threads(threads)
    device = _pick_device(settings, torch)
    dtype = _pick_dtype(settings, torch, device)
    if settings.degrade == INT8 and (reason := _no_int8_mode(settings, source, device, dtype, torch)) is not None:
        raise _refused(reason)  # before the model is read: nothing it holds could change this
    if not early and device == "cpu" and dtype == torch.float32:
        _start_builds(settings, source)
    location = sources.materialize(source, settings.cache_dir, clock)
    on_cpu_in_fp32 = device == "cpu" and dtype == torch.float32
    plan = _planned(settings, transformers, source, location, device, dtype, on_cpu_in_fp32)
    try:
        with clock.stage("tokenizer"):
            tokenizer = transformers.AutoTokenizer.from_pretrained(location)
        with clock.stage("model"):
            if source.kind == "gguf":
                model, applied = _from_gguf(settings, torch, transformers, source, location, device, dtype)
            else:
                model, applied = _from_pretrained(settings, torch, transformers, location, device, dtype), None
            model.eval()
            kv_dtype = plan.kv_dtype if plan is not None else str(dtype).removeprefix("torch.")
            half_cache.mark(model, kv_dtype)  # before grouped.page, which probes the f16 functions where it is f16
            arranged = _arrange(settings, model, torch, applied, on_cpu_in_fp32)
            layout, library, helpers, by_type, layers = arranged
            if device == "cpu" and settings.grouped_attention:
                grouped.group(model, torch)
            # Both engines' attention, request by request: the C attention, by the marked modules.
            if on_cpu_in_fp32 and settings.paged_attention:
                grouped.page(model, torch, settings.cache_dir / KERNEL_DIR)
            grouped.dispatch(model)  # the marked modules call the engine's attention function (none marked: nothing)
    except OSError as exc:
        raise StartupError(f"cannot load model {settings.model!r}: {exc}") from exc
    gen = model.generation_config
    eos = gen.eos_token_id if gen.eos_token_id is not None else tokenizer.eos_token_id
    context: Any = getattr(model.config, "max_position_embeddings", None) or getattr(
        tokenizer, "model_max_length", 2048
    )
    info = ModelInfo(
        name=source.name,
        source=source.location,
        device=str(model.device),
        dtype=str(dtype).removeprefix("torch."),
        context_length=int(context),
        threads=threads,
        weights=layout,
        weights_by_type=by_type,
        decoder=layers,
        kernel_helpers=helpers,
        modes=(NORMAL, INT8) if settings.degrade == INT8 else (NORMAL,),
        engine="single",  # the batched engine, which loads through here too, says "batched"
        weights_bytes=held_bytes(model),
        kv_cache_tokens=settings.kv_cache_tokens if plan is None else plan.kv_tokens,
        kv_cache_bytes=0 if plan is None else plan.kv_cache,
        kv_cache_dtype=kv_dtype,
        load_peak_rss_bytes=budget.peak_resident_bytes(),
    )
    return Loaded(
        torch=torch,
        tokenizer=tokenizer,
        model=model,
        eos=frozenset(eos if isinstance(eos, list) else [eos] if eos is not None else []),
        info=info,
        library=library,
    )


def _planned(
    settings: Settings,
    transformers: Any,
    source: sources.ModelSource,
    location: str,
    device: str,
    dtype: Any,
    on_cpu_in_fp32: bool,
) -> budget.Plan | None:
    """The memory plan of this load on CPU (engine/loading/budget.py), logged; raises :class:`StartupError` with the
    plan's sentence where the model does not fit, or where ``TTFT_KV_DTYPE`` is set for a model it does not apply to.
    None on a GPU, whose memory accelerate places (its KV cache in the model's dtype)."""
    if device != "cpu":
        if settings.kv_dtype != "auto":
            raise StartupError(
                f"TTFT_KV_DTYPE={settings.kv_dtype} is for the transformers engines on CPU in fp32; this model runs on "
                f"{device}, and its KV cache is in its dtype: unset TTFT_KV_DTYPE (or set it to auto)"
            )
        log.info("memory_not_planned", reason=f"the model runs on {device}")
        return None
    config = transformers.AutoConfig.from_pretrained(location)
    gguf = source.location if source.kind == "gguf" else None
    on_kernel = on_cpu_in_fp32 and settings.gguf_kernel and settings.torch_threads == 1
    dtype_name = str(dtype).removeprefix("torch.")
    int8 = gguf is not None and activations_for(settings, Path(gguf)) == "int8"
    plan, widened = budget.for_transformers(
        settings, source.kind, location, gguf, config, dtype_name, on_kernel, int8=int8
    )
    if widened is not None:
        log.warning("weights_widened", model=source.name, detail=widened)
    return budget.settle(plan)


def held_bytes(model: Any) -> int:
    """The bytes of weights ``model`` holds: its parameters, the block kernel's arrays and records, and the rows of
    an embedding read from the file (at most its table)."""
    seen: set[int] = set()
    total = 0

    def count(array: Any) -> None:
        nonlocal total
        if array is None:
            return
        pointer = array.data_ptr() if hasattr(array, "data_ptr") else array.ctypes.data
        if pointer not in seen:
            seen.add(pointer)
            total += int(array.numel() * array.element_size()) if hasattr(array, "numel") else int(array.nbytes)

    for module in model.modules():
        for parameter in module.parameters(recurse=False):
            count(parameter)
        for array in getattr(module, "arrays", ()):
            count(array)
        count(getattr(module, "records", None))
        count(getattr(module, "stored_rows", None))
    return total


def _plainly_cpu_fp32(settings: Settings) -> bool:
    """Whether the load runs on CPU in fp32 as far as can be told before torch is imported: CPU asked for, or
    ``auto`` on a machine without a GPU's device files (NVIDIA's, or ROCm's, which torch also calls CUDA)."""
    gpu = any(Path(node).exists() for node in GPU_NODES)
    return settings.dtype in ("auto", "float32") and (
        settings.device == "cpu" or (settings.device == "auto" and not gpu)
    )


def start_builds(settings: Settings, source: sources.ModelSource) -> bool:
    """Where the load plainly runs on CPU in fp32 (:func:`_plainly_cpu_fp32`), start the C libraries it builds there
    now; returns whether it did. ``ttft-sse prepare`` calls it before it converts the file, :func:`load_model` before
    its imports."""
    if _plainly_cpu_fp32(settings):
        _start_builds(settings, source)
        return True
    return False


def _start_builds(settings: Settings, source: sources.ModelSource) -> None:
    """The C libraries this load builds on CPU in fp32 (the block kernel's for a GGUF file, the paged attention's),
    started on the other core now (compiler.start), where they are not built yet: a first start converts the file and
    reads the model meanwhile (the block kernel's library alone takes 15-20 s to compile), instead of after."""
    directory = settings.cache_dir / KERNEL_DIR
    if settings.gguf_kernel and source.kind == "gguf":
        kernel.start(directory)
    if settings.paged_attention:
        attention.start(directory)


@contextmanager
def _imports_uncollected() -> Iterator[None]:
    """The first imports of torch and transformers without the cyclic garbage collector, then their garbage
    collected once and what they leave frozen (``gc.freeze``).

    Those imports make some 570,000 objects that live as long as the process, and the collector, triggered every
    few hundred allocations, scans them again and again: about a fifth of the imports' CPU time. Frozen, the
    modules, classes and functions are never scanned again, by the collections later in the load nor by those while
    serving. Only the first imports in a process: freezing objects a later load made (a model that goes away with
    an engine) could keep their cycles alive. Where the collector is off already, it stays off."""
    first = "transformers.modeling_utils" not in sys.modules
    if not first or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.collect()
        gc.freeze()
        gc.enable()


def _from_pretrained(settings: Settings, torch: Any, transformers: Any, location: str, device: str, dtype: Any) -> Any:
    """A model directory's (or a model id's) weights, read by transformers in ``dtype`` on ``device``."""
    # use_kernels=False: transformers (5.25, with the `kernels` package it depends on) otherwise swaps layers for
    # kernels it downloads from the Hugging Face Hub at load time on CUDA, and a server that is offline, as a
    # production one often is, fails to start ("not available in the local cache").
    kwargs: dict[str, Any] = {"dtype": dtype, "use_kernels": False}
    if device.startswith("cuda"):
        # accelerate places the weights; "auto" spreads a model too big for one GPU.
        kwargs["device_map"] = "auto" if settings.device == "auto" else device
    model = transformers.AutoModelForCausalLM.from_pretrained(location, **kwargs)
    return model if "device_map" in kwargs else model.to(device)


def _from_gguf(
    settings: Settings,
    torch: Any,
    transformers: Any,
    source: sources.ModelSource,
    location: str,
    device: str,
    dtype: Any,
) -> tuple[Any, kernel.Applied | None]:
    """A GGUF file's model, assembled from the file without expanding it (engine/loading/assembly.py): on CPU in
    fp32 its linear layers on the block kernel first, from the file's codes (kernel.apply: None where not tried),
    then every other weight read from the file one tensor at a time. Where the file cannot be assembled here,
    transformers loads it (dequantising every tensor), and the log says why."""
    gguf = Path(source.location)
    model = assembly.empty(location, torch, transformers, dtype)
    try:
        assembled = assembly.places(model, gguf, torch, Path(location))
    except assembly.NotAssembled as exc:
        log.warning("gguf_loaded_by_transformers", reason=str(exc))
        parent, name = str(gguf.parent), gguf.name
        loaded = transformers.AutoModelForCausalLM.from_pretrained(
            parent, gguf_file=name, dtype=dtype, use_kernels=False
        )
        return loaded.to(device), None
    on_cpu_in_fp32 = device == "cpu" and dtype == torch.float32
    applied = None
    read = assembly.fill_vectors(assembled, torch, dtype, device)
    if on_cpu_in_fp32 and settings.gguf_kernel:
        rows = activations_for(settings, gguf)
        if rows != settings.gguf_activations:
            size = f"a {gguf.stat().st_size / 2**30:.1f} GiB file"
            log.info("activations_chosen", activations=rows, reason=f"{size} (TTFT_GGUF_ACTIVATIONS=auto)")
        try:
            applied = kernel.apply(
                model,
                assembled.stored,
                torch,
                directory=settings.cache_dir / KERNEL_DIR,
                cache=Path(location),
                activations=rows,
                degrade=settings.degrade == INT8,
            )
        except kernel.Refused as exc:  # only with degrade: the int8 mode cannot exist
            raise _refused(str(exc)) from exc
    read += assembly.fill(assembled, torch, dtype, device, rows_from_file=on_cpu_in_fp32)
    assembled.stored.close()
    log.info("gguf_assembled", read_mib=round(read / 2**20, 1), on_kernel=applied is not None and applied.activations)
    return model.to(device), applied


LARGE_FILE_BYTES = budget.LARGE_FILE_BYTES
"""From this size of GGUF file up, ``TTFT_GGUF_ACTIVATIONS=auto`` gives the block kernel int8 rows (and
``TTFT_KV_DTYPE=auto`` an f16 KV cache: engine/loading/budget.py)."""


def activations_for(settings: Settings, gguf: Path) -> str:
    """The block kernel's rows for the GGUF file ``gguf``: ``TTFT_GGUF_ACTIVATIONS``, or for ``auto`` int8 rows for a
    file of :data:`LARGE_FILE_BYTES` or more (a 7B model's prompt of a few dozen tokens takes 1.3-1.6 s in fp32 rows
    on 2 cores, 0.5 s in int8 ones: docs/performance.md), fp32 rows below it and wherever ``TTFT_DEGRADE=int8`` keeps
    them for its switch."""
    if settings.gguf_activations != "auto":
        return settings.gguf_activations
    if settings.degrade == INT8 or gguf.stat().st_size < LARGE_FILE_BYTES:
        return "fp32"
    return "int8"


def _arrange(
    settings: Settings, model: Any, torch: Any, applied: kernel.Applied | None, on_cpu_in_fp32: bool
) -> tuple[str, Path | None, int, dict[str, str], str]:
    """Lay the weights out for the CPU kernels (engine/kernels/weights.py), around the block kernel's layers where
    :func:`_from_gguf` made some (``applied``). Returns the layout, the block kernel's library (None where it serves
    no layer), how many helper threads it started, the path of each GGUF type's layers (empty where the block
    kernel was not tried or could not run) and what ``/readyz`` says of the decoder layers (engine/library/decoder.py's
    label)."""
    if not on_cpu_in_fp32:
        return "as loaded", None, 0, {}, families.label(model, tried="the C layers are for fp32 on CPU")
    applied = applied or kernel.Applied(None, {})
    degrade = settings.degrade == INT8
    # The layers left (none of the bundled model's with the block kernel) get the fp32 layouts.
    layout = weights.arrange(model, torch, packed=settings.packed_weights)
    library: Path | None = None
    helpers = 0
    activations = applied.activations
    tried: str | None = (
        "the block kernel serves none of its linear layers (a GGUF file's blocks or F16/BF16/F32 values)"
    )
    if activations is not None:
        tried = None if settings.fused_layers else "TTFT_FUSED_LAYERS=false"
        library = kernel.build(settings.cache_dir / KERNEL_DIR)
        if settings.fused_layers:  # after arrange: it copies the norms' weights
            decoder.fuse(model, torch, library)  # with degrade, both arrangements or neither
        if degrade:  # the price of the run-time switch: the int8 records, held beside the fp32 panels
            held = [m.records for m in model.modules() if getattr(m, "records", None) is not None]
            fused = sum(getattr(m, "arithmetic_int8", None) is not None for m in model.modules())
            mib = round(sum(r.numel() * r.element_size() for r in held) / 2**20, 1)
            log.info("degrade_ready", modes=[NORMAL, INT8], int8_records_mib=mib, layers=len(held), fused=fused)
        helpers = kernel.start_helpers(library, settings.helper_threads)
        log.info("kernel_helpers", helpers=helpers, asked=settings.helper_threads)
        blocks = "gguf-blocks-int8" if activations == "int8" else "gguf-blocks"
        plain = any(type(m) is torch.nn.Linear for m in model.modules())
        layout = f"{blocks}+{layout}" if plain else blocks
    layers = families.label(model, tried=tried)
    log.info("weights_arranged", layout=layout, decoder=layers)
    return layout, library, helpers, applied.by_type, layers


def _no_int8_mode(settings: Settings, source: sources.ModelSource, device: str, dtype: Any, torch: Any) -> str | None:
    """Why the int8 mode (``TTFT_DEGRADE=int8``: the block kernel's int8 rows) cannot exist with these settings, as
    far as they tell before the model is read; None where it may (the kernel's own checks come at load)."""
    if not settings.gguf_kernel:
        return "TTFT_GGUF_KERNEL=false turns off the block kernel, whose int8 rows it is"
    if source.kind != "gguf":
        return f"it needs a GGUF model's quantised blocks, and {source.location!r} is a {source.kind} model"
    if device != "cpu" or dtype != torch.float32:
        runs = f"{device} in {str(dtype).removeprefix('torch.')}"
        return f"it is the CPU block kernel's, for fp32 on CPU; the model runs on {runs}"
    if settings.torch_threads > 1:
        return f"the block kernel runs on one torch thread, and TTFT_THREADS gives {settings.torch_threads}"
    return None


def _refused(reason: str) -> StartupError:
    log.error("degrade_refused", reason=reason)
    return StartupError(f"TTFT_DEGRADE=int8 cannot run here: {reason}. Set TTFT_DEGRADE=off, or see docs/engine.md")


def _pick_device(settings: Settings, torch: Any) -> str:
    wanted = settings.device
    if wanted == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if wanted.startswith("cuda") and not torch.cuda.is_available():
        raise StartupError(f"device {wanted!r} was asked for but torch sees no CUDA device")
    return wanted


def _pick_dtype(settings: Settings, torch: Any, device: str) -> Any:
    wanted = settings.dtype
    if wanted != "auto":
        return getattr(torch, wanted)
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32
