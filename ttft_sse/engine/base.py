"""The engine interface and the value types that cross it. Imports no torch: the HTTP layer depends on this alone.

An engine turns a prepared prompt into an async stream of :class:`Piece` items followed by exactly one
:class:`Finished`. Closing the stream early (``aclose()``, or cancelling the task that iterates it) cancels the
generation; the engine must not leave a thread or a slot behind when it does.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from ttft_sse.stages import StageClock

Role = Literal["system", "user", "assistant", "tool"]
ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")
FinishReason = Literal["stop", "length", "cancelled"]
NORMAL = "normal"
"""The mode every engine has: its normal arithmetic (on CPU with the block kernel, fp32 rows: the fp32 model's
answers)."""
INT8 = "int8"
"""The faster mode the CPU engine may be switched to with ``TTFT_DEGRADE=int8``: the block kernel's int8 rows."""


@dataclass(frozen=True)
class ChatMessage:
    role: Role
    content: str
    # A tool message's answer to a tool call (OpenAI's field), handed to the chat template as the message's own.
    tool_call_id: str | None = None


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # Computed before the requests waiting beside it that are not (the high lane's: a batched engine prefills an
    # urgent prompt in a step of its own when others wait with it). Scheduling only: the answer is the same.
    urgent: bool = False
    # Seconds a request that is not urgent may go without a token while a batched engine gives its rows to urgent
    # ones (its lane's first-token target; None: the engine's default, engine/library/turns.py). Scheduling only.
    patience: float | None = None
    # Keeps the request's prefix-cache blocks apart from those of requests with another salt (empty: the shared
    # cache). The caller's key and the request's own ``cache_salt`` make it (ttft_sse/admission/isolation.py).
    # Scheduling only: the answer is the same, only what the cache may reuse for it differs.
    cache_salt: str = ""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class Prompt:
    """A tokenized prompt, ready for the model. ``text`` is what the chat template produced."""

    text: str
    token_ids: tuple[int, ...]

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class Piece:
    """A piece of generated text, emitted the moment it is decodable. Never empty."""

    index: int
    text: str


@dataclass(frozen=True)
class Progress:
    """How far a prompt's pass is, for a prompt computed over several steps: ``computed`` of its ``prompt_tokens``
    are in the KV cache (cached ones included). Emitted before the first :class:`Piece`, at most a few a second."""

    prompt_tokens: int
    computed: int


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    # Prompt tokens whose KV came from the prefix cache (an earlier request's, or a prefill's) instead of being
    # computed for this request: OpenAI's ``usage.prompt_tokens_details.cached_tokens``.
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def as_dict(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
            "cached_tokens": self.cached_tokens,
        }

    def openai_dict(self) -> dict[str, Any]:
        """The OpenAI API's shape: the cached tokens under ``prompt_tokens_details``."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass(frozen=True)
class Finished:
    """The last item of every stream that was not cancelled."""

    finish_reason: FinishReason
    usage: Usage
    # Engine-side timings in milliseconds: prefill_ms (generation start → first token), decode_ms (first → last
    # token). The HTTP layer adds its own (ttft_ms, queue_ms, total_ms).
    timings: dict[str, float] = field(default_factory=dict)
    # True when any of the request's tokens, its prompt's pass included, was computed in a mode other than
    # "normal" (Engine.set_mode): its answer is not the normal arithmetic's. Conservative: never False when it was.
    degraded: bool = False


@dataclass(frozen=True)
class ModelInfo:
    name: str
    source: str
    device: str
    dtype: str
    context_length: int
    threads: int
    # How the weights are laid out for the kernels (shown by /readyz): "as loaded", "column-major",
    # "column-major+packed" (engine/kernels/weights.py), "gguf-blocks" (engine/kernels/kernel.py;
    # "gguf-blocks+column-major+packed" when some layers are not stored as blocks).
    weights: str = "as loaded"
    # For a GGUF on the block kernel, the path of each GGUF type's linear layers (engine/kernels/codes.py's by_type),
    # e.g. {"Q4_K": "blocks: 168", "F16": "fp32: 42 (not quantised)"}; else empty.
    weights_by_type: dict[str, str] = field(default_factory=dict)
    # Whether the decoder layers run in C (engine/library/decoder.py's label), e.g. "fused: 30 of 30 layers", or
    # "not fused (Phi3DecoderLayer: no fused form); each layer runs in transformers' Python"; empty where no model.
    decoder: str = ""
    # The block kernel's helper threads (engine/kernels/kernel.py), 0 without them.
    kernel_helpers: int = 0
    # Who else may give the first token of a request that arrives while the batched engine's step runs, and its
    # state: "interludes ready" (engine/first/interlude.py), "prefill-process loading" (engine/first/process.py),
    # ..., or "none".
    beside_batch: str = "none"
    # The modes Engine.set_mode takes, "normal" first: ("normal", "int8") for the CPU engine started with
    # TTFT_DEGRADE=int8 (docs/engine.md, "Degraded mode").
    modes: tuple[str, ...] = (NORMAL,)
    # Which engine runs the model (/readyz's "engine"): "batched", "single", "llamacpp", "fake".
    engine: str = ""
    # Memory (/readyz's "memory"): the bytes of weights held, the KV cache's tokens (TTFT_KV_CACHE_TOKENS, or fewer
    # where the memory plan made it smaller: engine/loading/budget.py), bytes and values' dtype ("float32",
    # "float16": TTFT_KV_DTYPE), and the most the process held resident while it loaded.
    weights_bytes: int = 0
    kv_cache_tokens: int = 0
    kv_cache_bytes: int = 0
    kv_cache_dtype: str = ""
    load_peak_rss_bytes: int = 0


Hold = Callable[[], bool] | None
"""What a prefill asks between its steps: while it answers True (a request waits for a slot), the prefill waits."""


class Engine(Protocol):
    """What the HTTP layer needs from a model. ``load`` and ``prepare`` block; call them off the event loop."""

    @property
    def info(self) -> ModelInfo: ...

    @property
    def active(self) -> int:
        """Generations running right now."""
        ...

    def load(self, clock: StageClock) -> None:
        """Load tokenizer and model, timing each stage on ``clock``. Called once, in a worker thread."""
        ...

    def prepare(
        self, *, prompt: str | None, messages: Sequence[ChatMessage] | None, raw: bool, parse_special: bool = False
    ) -> Prompt:
        """Render and tokenize (engine/prompts.py): message content is always text; ``parse_special`` reads the
        special-token strings of a raw prompt as special tokens. Raises ``PromptTooLong`` when the prompt cannot fit
        the context."""
        ...

    def stream(self, prompt: Prompt, params: SamplingParams) -> AsyncGenerator[Progress | Piece | Finished, None]:
        """Generate. ``Progress`` while a long prompt is computed, pieces as they are decoded, then one
        ``Finished``. Raises ``EngineError`` on failure."""
        ...

    def prepare_prefix(self, *, prompt: str | None, messages: Sequence[ChatMessage] | None, raw: bool) -> Prompt:
        """The tokens that every request completing this one's last message will start with: its prompt up to the
        end of that message's text so far, less the tokens whose split may still change as text is added
        (engine/prompts.py's :func:`~ttft_sse.engine.prompts.stable_prefix`). Blocks, as :meth:`prepare`."""
        ...

    def cached(self, prompt: Prompt, cache_salt: str = "") -> int:
        """Leading tokens of ``prompt`` whose KV the prefix cache holds now for requests of ``cache_salt``."""
        ...

    async def prefill(self, prompt: Prompt, *, cache_salt: str = "", owner: str = "", hold: Hold = None) -> int:
        """Compute the KV of ``prompt`` into the prefix cache as background work, and keep it there a while
        (``TTFT_PREFILL_KEEP_SECONDS``, then evicted like any prefix; the keep of an earlier prefill of the same
        ``owner`` ends when this one's starts). It waits, between steps, while ``hold()`` is true (a request waits
        for a slot). Returns the tokens it computed. Cancelling it stops the computation at its next step."""
        ...

    @property
    def mode(self) -> str:
        """The mode the last :meth:`set_mode` asked for (``"normal"`` until then)."""
        ...

    def set_mode(self, mode: str) -> None:
        """Compute new steps in ``mode``, one of ``info.modes``; raises ``ValueError`` for another. Takes effect
        between two steps, never inside one; a request computed in both modes says so (``Finished.degraded``). Safe
        from any thread; it does not block."""
        ...

    async def close(self) -> None:
        """Cancel every running generation and wait for their threads to end."""
        ...


@runtime_checkable
class KeepsWarm(Protocol):
    """An engine that keeps a prompt's KV in its prefix cache for good (``TTFT_WARM_PROMPTS``). One without it
    computes warm prompts as prefills (:meth:`Engine.prefill`: kept a while, then cached like any prefix)."""

    async def warm(self, prompt: Prompt) -> int:
        """Compute ``prompt`` into the prefix cache and keep it there for good, within a bound of tokens; the tokens
        kept (0: not kept, for the bound or where the engine shares no prefixes)."""
        ...


@runtime_checkable
class StoresPrefixes(Protocol):
    """An engine whose prefix cache survives a restart (``TTFT_PREFIX_STORE_MB``): written to the cache directory
    on drain, read back at start (the batched and the llama.cpp engines). The single engine keeps no prefix cache."""

    async def store_prefixes(self) -> None:
        """Write the pinned and the most used prefixes' KV to the cache directory, within the setting's bound."""
        ...

    async def restore_prefixes(self) -> None:
        """Read the prefixes written at the last drain back into the prefix cache, if the file is this server's."""
        ...


def check_mode(mode: str, modes: Sequence[str]) -> None:
    """Raise ``ValueError`` unless ``mode`` is one of ``modes`` (an engine's ``info.modes``)."""
    if mode not in modes:
        hint = "" if len(modes) > 1 else " (TTFT_DEGRADE=int8 gives the CPU engine an int8 mode)"
        raise ValueError(f"mode must be one of {', '.join(modes)}, got {mode!r}{hint}")


async def keep_warm(engine: Engine, prompt: Prompt) -> int:
    """``prompt`` computed into ``engine``'s prefix cache: kept for good where it :class:`KeepsWarm` (the tokens
    kept), else as a prefill (0)."""
    if isinstance(engine, KeepsWarm):
        return await engine.warm(prompt)
    await engine.prefill(prompt)
    return 0
