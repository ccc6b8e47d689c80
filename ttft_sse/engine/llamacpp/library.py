"""llama.cpp through llama-cpp-python's low-level binding (``llama_cpp.llama_cpp``, ctypes): a model, one context
with ``sequences`` sequences of KV cells, a batch, a decode, a row of logits, a sequence's cells freed, a sequence's
state (its cells as bytes) copied out and put back.

Only the engine's loop thread calls a :class:`Runner` after :func:`open_runner` (llama.cpp's context is not safe
across threads). ``llama-cpp-python`` is an optional dependency (``pip install 'ttft-sse[llamacpp]'``): it is
imported here, when a runner is opened, never at import.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog

from ttft_sse.engine.llamacpp.schedule import Row
from ttft_sse.errors import EngineError, StartupError

log = structlog.get_logger("ttft_sse.engine")

DISTRIBUTION = "llama-cpp-python"
VERSION = "0.3.36"
"""The version whose low-level API this module is written against (pinned in pyproject.toml's ``llamacpp`` extra)."""

_LOG_LEVELS = {3: "warning", 4: "error"}  # ggml_log_level: 1 debug, 2 info, 3 warn, 4 error; only these pass
_log_callback: Any = None  # the ctypes callback must outlive every call into the library


def installed() -> str | None:
    """The installed llama-cpp-python version, or None."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def binding() -> Any:
    """``llama_cpp.llama_cpp``, or a StartupError that says how to install it."""
    version = installed()
    if version is None:
        raise StartupError(
            f"TTFT_ENGINE=llamacpp needs {DISTRIBUTION}: pip install 'ttft-sse[llamacpp]' (a source build, minutes)"
        )
    if version != VERSION:
        raise StartupError(f"TTFT_ENGINE=llamacpp is written for {DISTRIBUTION}=={VERSION}, and {version} is installed")
    import llama_cpp.llama_cpp as lib

    return lib


ROWS_PER_STEP = 63
"""The most rows a step computes. ggml's CPU flash attention takes a tiled kernel from 64 query rows a step
(``GGML_FA_TILE_Q``), whose bits differ from the row-by-row kernel's: below it, a row's attention is the same
whatever else the step holds, so a request's answer does not depend on the others (docs/engine.md). Measured on the
bundled model (AMD EPYC, 1 thread, a 1,024-token prompt): 9.3-9.9 s in 63-row steps against 7.7-8.4 s in 512-row
ones."""


@dataclass(frozen=True)
class Shape:
    """What the engine asks of llama.cpp."""

    cells: int  # KV cells, split evenly between the sequences
    sequences: int
    batch_tokens: int  # rows a decode takes at most (one physical batch: one graph a step)
    threads: int


class Runner:
    """A loaded model and its context. Close it from the thread that used it."""

    def __init__(self, lib: Any, model: Any, context: Any, shape: Shape, choices: dict[str, Any]) -> None:
        self._lib = lib
        self._model = model
        self._context = context
        self._memory = lib.llama_get_memory(context)
        self._vocab = lib.llama_model_get_vocab(model)
        self.vocabulary = int(lib.llama_vocab_n_tokens(self._vocab))
        self.trained_context = int(lib.llama_model_n_ctx_train(model))
        buffer = ctypes.create_string_buffer(256)
        lib.llama_model_desc(model, buffer, len(buffer))
        self.description = buffer.value.decode(errors="replace")  # e.g. "llama ?B Q4_1"
        self.shape = shape
        self.cells_per_sequence = int(lib.llama_n_ctx_seq(context))
        self.choices = choices
        """The context's parameters that decide a KV cell's bytes and layout (the cache's types, flash attention, a
        stream of cells per sequence)."""
        self.system = bytes(lib.llama_print_system_info() or b"").decode(errors="replace").strip()
        """The CPU features llama.cpp's build uses here (its kernels: ``AVX512 = 1 | ...``)."""
        self._batch = lib.llama_batch_init(shape.batch_tokens, 0, 1)
        self._closed = False

    def decode(self, rows: Sequence[Row]) -> None:
        """Compute ``rows`` (at most ``shape.batch_tokens``) in one ``llama_decode``; their KV goes into the cells of
        their sequences."""
        batch = self._batch
        for i, row in enumerate(rows):
            batch.token[i] = row.token
            batch.pos[i] = row.position
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = row.seq
            batch.logits[i] = row.logits
        batch.n_tokens = len(rows)
        status = int(self._lib.llama_decode(self._context, batch))
        if status != 0:
            raise EngineError(f"llama_decode failed with status {status} for a step of {len(rows)} rows")

    def logits(self, row: int) -> np.ndarray:
        """The logits of the batch's ``row`` (one that asked for them), a view valid until the next decode."""
        pointer = self._lib.llama_get_logits_ith(self._context, row)
        return np.ctypeslib.as_array(pointer, shape=(self.vocabulary,))

    def forget(self, seq: int) -> None:
        """Free every KV cell of sequence ``seq``."""
        self._lib.llama_memory_seq_rm(self._memory, seq, -1, -1)

    def keep(self, seq: int, tokens: int) -> bool:
        """Free the KV cells of sequence ``seq`` past its first ``tokens`` positions. False where the model's memory
        cannot drop part of a sequence (llama.cpp's recurrent state): nothing is freed then."""
        return bool(self._lib.llama_memory_seq_rm(self._memory, seq, tokens, -1))

    def last_position(self, seq: int) -> int:
        """The last position sequence ``seq`` holds in the KV cache, -1 when it holds none."""
        return int(self._lib.llama_memory_seq_pos_max(self._memory, seq))

    def state_size(self, seq: int) -> int:
        """The bytes of sequence ``seq``'s state: the positions of its cells and every layer's keys and values in
        them (llama.cpp's ``llama_state_seq_get_size``)."""
        return int(self._lib.llama_state_seq_get_size(self._context, seq))

    def state(self, seq: int) -> np.ndarray:
        """Sequence ``seq``'s state as bytes (uint8), as llama.cpp writes it."""
        size = self.state_size(seq)
        data = np.empty(size, dtype=np.uint8)
        written = int(self._lib.llama_state_seq_get_data(self._context, _bytes(data), size, seq))
        return data[:written]

    def set_state(self, seq: int, state: np.ndarray) -> bool:
        """Put ``state`` (of :meth:`state`) into sequence ``seq``'s cells, in place of what they held. False where
        llama.cpp refuses it (too few cells, another layout; it logs why): the sequence holds nothing then."""
        data = np.ascontiguousarray(state, dtype=np.uint8)
        return int(self._lib.llama_state_seq_set_data(self._context, _bytes(data), data.size, seq)) > 0

    def clear(self) -> None:
        """Free every sequence's cells."""
        self._lib.llama_memory_clear(self._memory, True)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._lib.llama_batch_free(self._batch)
        self._lib.llama_free(self._context)
        self._lib.llama_model_free(self._model)


def open_runner(path: str, shape: Shape) -> Runner:
    """Load the GGUF at ``path`` (on CPU) and make its context. Raises StartupError when llama.cpp cannot."""
    lib = binding()
    _quiet(lib)
    lib.llama_backend_init()
    model_params = lib.llama_model_default_params()
    model_params.n_gpu_layers = 0
    model = lib.llama_model_load_from_file(path.encode(), model_params)
    if not model:
        raise StartupError(f"llama.cpp cannot load {path}")
    params = lib.llama_context_default_params()
    params.n_ctx = shape.cells
    params.n_batch = params.n_ubatch = shape.batch_tokens
    params.n_seq_max = shape.sequences
    params.n_threads = params.n_threads_batch = shape.threads
    # Each sequence its own stream of cells (as llama-server's slots by default: the context split between them), its
    # tokens in them in the order of their positions. In one pool shared by all, a sequence's later tokens may take
    # cells freed before its earlier ones, and flash attention, which sums a row's cells in the order they sit, gives
    # other bits than the same request alone.
    params.kv_unified = False
    # Flash attention on CPU computes each query row on its own for steps of fewer than ROWS_PER_STEP + 1 rows; without
    # it, the step's query rows are one matrix product and a row's bits depend on how many others it has.
    params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
    params.no_perf = True
    context = lib.llama_init_from_model(model, params)
    if not context:
        lib.llama_model_free(model)
        raise StartupError(f"llama.cpp cannot make a context of {shape.cells} cells for {path}")
    choices = {
        "type_k": int(params.type_k),
        "type_v": int(params.type_v),
        "flash_attn": int(params.flash_attn_type),
        "kv_unified": bool(params.kv_unified),
    }
    return Runner(lib, model, context, shape, choices)


def _bytes(data: np.ndarray) -> Any:
    """``data``'s buffer as the ``uint8_t *`` llama.cpp's state calls take."""
    return data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))


def _quiet(lib: Any) -> None:
    """llama.cpp's log lines go to structlog, errors and warnings only (it prints every load's details otherwise)."""
    global _log_callback
    if _log_callback is not None:
        return

    def forward(level: int, text: bytes, _: Any) -> None:
        name = _LOG_LEVELS.get(level)
        if name is not None and text:
            getattr(log, name)("llama_cpp", message=text.decode(errors="replace").rstrip())

    _log_callback = lib.llama_log_callback(forward)
    lib.llama_log_set(_log_callback, ctypes.c_void_p(0))
