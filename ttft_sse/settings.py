"""Settings: built once, at the edge, from the environment (``TTFT_`` prefix) and CLI flags.

This module is the only reader of ``os.environ`` in the package. Everything else receives a frozen
:class:`Settings` and never looks at the environment again.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints

from ttft_sse.admission.gate import Lane
from ttft_sse.admission.targets import parse_targets
from ttft_sse.http.hosts import default_allowed_hosts, parse_hosts

ENV_PREFIX = "TTFT_"
ENGINES = ("batched", "single", "llamacpp", "auto")
"""What ``engine`` takes: the transformers engines, llama.cpp's (a GGUF model, with the ``llamacpp`` extra), or the
faster of batched and llamacpp for this model file, measured once (engine/choice.py)."""


class SettingsError(ValueError):
    """A setting has a value it cannot take. The message names the setting and what it accepts."""


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ttft-sse"


def auto_threads(cores: int) -> int:
    """Half of ``cores`` (the process's usable cores: :func:`usable_cores`), at least one.

    torch's OpenMP workers spin-wait for each other: once anything else (the event loop, the HTTP stack, a client)
    takes one of their cores, a decode step runs many times slower. Leaving half the cores to the rest keeps the
    model off that cliff.
    """
    return max(1, cores // 2)


MAX_KERNEL_HELPERS = 8
"""helpers.c's ``HELPERS``."""


CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
"""cgroup v2's CPU quota of this process's group (a container's ``--cpus``): ``max 100000``, or quota and period."""


def usable_cores(cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """The cores this process may run on: its affinity (``os.cpu_count()`` where that is not known), at most its
    cgroup's CPU quota, whole cores only (a quota of 1.5 CPUs is 1)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        quota, period = cpu_max.read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass  # no cgroup v2 quota to read
    return cores


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8000
    model: str = "bundled"
    engine: str = "batched"
    device: str = "auto"
    dtype: str = "auto"
    # fp32 on CPU: keep a oneDNN pre-packed copy of every linear weight for 2-32 rows (engine/kernels/weights.py).
    packed_weights: bool = True
    # fp32 on CPU, a GGUF model: layers stored as Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K run on the block kernel from
    # the file's own blocks, in fp32 (engine/kernels/kernel.py).
    gguf_kernel: bool = True
    # The block kernel's rows: "fp32", the fp32 model's arithmetic; "int8", quantised per block of 32 inputs as
    # llama.cpp does (AVX-512 VNNI or AVX2): faster, other answers; "auto", int8 for a GGUF file of 2 GiB or more (a
    # 3B model and up, whose fp32-row prompts take seconds on a few cores), fp32 below and with TTFT_DEGRADE=int8.
    gguf_activations: str = "auto"
    # The faster mode the engine may be switched to at run time (Engine.set_mode): "off", or "int8", the block
    # kernel's int8 rows beside its fp32 ones (both arrangements held: more memory). Where the mode cannot run, the
    # server refuses to start.
    degrade: str = "off"
    # With the block kernel (fp32 or int8 rows): each Llama decoder layer's norms, projections, rotary embedding and
    # MLP in two C calls around its attention instead of ~40 torch calls; in the batched engine's steps, the whole
    # layer, cache write and attention included, in one (engine/library/decoder.py).
    fused_layers: bool = True
    # On CPU: masked attention (the batched engine's steps) reads grouped KV heads in place (engine/library/grouped.py).
    grouped_attention: bool = True
    # On CPU, fp32: the batched engine's steps attend request by request, reading the paged KV cache in place
    # (engine/kernels/attention.py), instead of one masked attention over the whole step's gathered keys; the single
    # engine attends with the same C function, so both give a request the same text.
    paged_attention: bool = True
    # On CPU, the batched engine: a second process with its own copy of the model computes the first token of a
    # request that arrives while the batch is busy, on another core (engine/first/process.py).
    prefill_process: bool = True
    # On CPU, the batched engine with the decoder layers in C: a request that arrives while the batch is busy has its
    # prompt computed between two layers of the step in flight, and the batch reuses its KV
    # (engine/first/interlude.py). Where it runs, the prefill process does not.
    prefill_between_layers: bool = True
    threads: int = 0
    # The block kernel's helper threads (engine/kernels/kernel.py): a linear layer's panels shared with threads that run
    # only on a core nothing else wants (SCHED_IDLE). -1: one, where the process may use two cores or more.
    kernel_helpers: int = -1
    cache_dir: Path = field(default_factory=_default_cache_dir)
    warmup: bool = True
    default_max_tokens: int = 256
    max_tokens_cap: int = 2048
    # Prompt tokens one request may bring (0: up to the model's context): a bound on how long one caller's prompt
    # holds a generation slot while it is computed.
    max_prompt_tokens: int = 0
    max_body_bytes: int = 1_048_576
    # Read any body as JSON whatever its Content-Type (else 415 for all but application/json and +json types):
    # only where no browser can reach the server (see api/body.py: the labels browsers send cross-site unasked).
    allow_any_content_type: bool = False
    # Origins whose pages may open the /chat WebSocket besides the server's own host, comma-separated
    # (`https://app.example.com`), or `*` for any; see api/chat.py (browsers apply no CORS check to a WebSocket).
    chat_origins: str | None = None
    # Transport limits (docs/operations.md, "Limits and timeouts"). A request's head must arrive within
    # header_timeout_seconds of its first byte and be at most max_header_bytes (HTTP/1.1), its body within
    # body_timeout_seconds of the request's arrival (408 after); an idle connection is closed after
    # keep_alive_seconds: above the idle timeouts of common proxies (nginx upstream keepalive_timeout 60 s, cloud
    # load balancers 60 s), so that the proxy closes an idle connection first and never sends a request down one
    # that hypercorn is closing.
    header_timeout_seconds: float = 10.0
    max_header_bytes: int = 16_384
    body_timeout_seconds: float = 30.0
    keep_alive_seconds: float = 75.0
    max_concurrency: int = 8
    max_queue: int = 32
    batch_tokens: int = 512
    # Prompt tokens a batched step computes beside streams that are decoding (chunked prefill; fewer once a long
    # prompt's attention grows: engine/library/scheduler.py): their gap between tokens while a long prompt prefills
    # stays a few decode steps. 0: no limit.
    prefill_chunk_tokens: int = 16
    kv_cache_tokens: int = 8192
    # The transformers engines' KV cache on CPU in fp32 (engine/library/half_cache.py): "fp32", the fp32 model's
    # answers;
    # "f16", half the memory, keys and values rounded to fp16 as they are stored (answers may differ); "auto", f16 for
    # a GGUF file of 2 GiB or more or where the fp32 cache would not fit the memory plan, fp32 otherwise.
    kv_dtype: str = "auto"
    # Memory the server may use, in MiB (0: what the machine has available, or its cgroup's limit where lower). The
    # model's weights, KV cache and working memory are planned against it before loading (engine/loading/budget.py):
    # a KV cache that does not fit is made smaller, a model that does not fit is refused at start.
    memory_limit_mb: int = 0
    prefix_cache: bool = True
    # POST /prefill (docs/streams.md, "Prefill while the user types"): how long a prefill's KV is pinned in the
    # cache for the request that follows it (0: not pinned, only cached like any prefix), and how many prefills one
    # API key may have computing at once (past it, 429).
    prefill_keep_seconds: float = 60.0
    prefill_per_key: int = 4
    # A JSON Lines file of prompts (``prompt`` or ``messages``) computed before /readyz turns 200 and kept in the
    # prefix cache for good, within a quarter of it (ttft_sse/prefixes/warm_prompts.py; docs/settings.md, "Warm
    # prompts"). The file's lines are checked where the server starts (__main__.py), not here: they are requests, which
    # settings know nothing of.
    warm_prompts: str | None = None
    # The prefix store, in MiB (0: off): on drain the pinned and most used prefixes' KV is written to the cache
    # directory, and read back at the next start before /readyz turns 200 (engine/batched/prefix_store.py,
    # engine/llamacpp/prefix_store.py; docs/settings.md, "Prefixes that survive a restart"). Off by default: the file
    # holds users' prompts.
    prefix_store_mb: int = 0
    # Whose requests share prefix-cache blocks: "shared" (everyone's) or "key" (each API key's apart): the timing
    # trade-off is in docs/settings.md, "Isolation".
    prefix_isolation: str = "shared"
    queue_timeout_seconds: float = 30.0
    ping_seconds: float = 15.0
    drain_seconds: float = 10.0
    resume_grace_seconds: float = 30.0
    max_streams: int = 64
    stream_buffer_events: int = 4096
    log_level: str = "info"
    log_format: str = "json"
    redis_url: str | None = None
    # On CUDA, hand the caching allocator's unused blocks back to the driver after every Nth generation
    # (0 = never), so that one long prompt's peak does not stay reserved for good.
    cuda_empty_cache_every: int = 1000
    # The names this server answers to (Host header), `name,*.domain,[::1]` or `*` (ttft_sse/http/hosts.py). None: any;
    # from_env (what `ttft-sse serve` reads) fills it from host: the loopback names on a loopback address, else `*`.
    allowed_hosts: str | None = None
    # `key[:lane],…` or `@file`; see ttft_sse/admission/auth.py. Out of repr so that a logged Settings shows no key.
    api_keys: str | None = field(default=None, repr=False)
    # First-token targets per lane, `high:200,normal:1000,low:5000` (ms; see ttft_sse/admission/targets.py). Unset:
    # none.
    sla_ms: str | None = None
    # Generation slots of max_concurrency only the high lane may take. -1: none (the extra slots below keep the
    # high lane's room without taking any from the others).
    high_reserved_slots: int = -1
    # Rows a step of the batch computes past max_concurrency: the high lane is admitted up to max_concurrency + these
    # generations of its own, whatever the other lanes hold (ttft_sse/admission/gate.py; the batched engine leaves
    # theirs out of steps in turn for it). -1: max_concurrency / 2 (at least 1) where TTFT_SLA_MS sets a high target.
    high_extra_slots: int = -1
    job_runners: int = 1
    max_jobs: int = 1000
    job_ttl_seconds: float = 600.0
    job_lease_seconds: float = 30.0
    job_attempts: int = 3

    def __post_init__(self) -> None:
        positive = (
            "port",
            "default_max_tokens",
            "max_tokens_cap",
            "max_body_bytes",
            "max_header_bytes",
            "max_concurrency",
            "max_streams",
            "stream_buffer_events",
            "job_runners",
            "max_jobs",
            "job_attempts",
            "batch_tokens",
            "kv_cache_tokens",
            "prefill_per_key",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise SettingsError(f"{name} must be at least 1, got {getattr(self, name)}")
        zero_or_more = (
            "threads",
            "max_queue",
            "cuda_empty_cache_every",
            "prefill_chunk_tokens",
            "max_prompt_tokens",
            "memory_limit_mb",
            "prefill_keep_seconds",
            "prefix_store_mb",
        )
        for name in zero_or_more:
            if getattr(self, name) < 0:
                raise SettingsError(f"{name} must be 0 or more, got {getattr(self, name)}")
        more_than_zero = (
            "queue_timeout_seconds",
            "ping_seconds",
            "drain_seconds",
            "job_ttl_seconds",
            "job_lease_seconds",
            "resume_grace_seconds",
            "header_timeout_seconds",
            "body_timeout_seconds",
            "keep_alive_seconds",
        )
        for name in more_than_zero:
            if getattr(self, name) <= 0:
                raise SettingsError(f"{name} must be more than 0, got {getattr(self, name)}")
        if self.kernel_helpers < -1 or self.kernel_helpers > MAX_KERNEL_HELPERS:
            raise SettingsError(
                f"kernel_helpers must be -1 (auto) or 0 to {MAX_KERNEL_HELPERS}, got {self.kernel_helpers}"
            )
        if self.default_max_tokens > self.max_tokens_cap:
            raise SettingsError(
                f"default_max_tokens ({self.default_max_tokens}) is above max_tokens_cap ({self.max_tokens_cap})"
            )
        if self.engine not in ENGINES:
            raise SettingsError(f"engine must be {', '.join(ENGINES[:-1])} or {ENGINES[-1]}, got {self.engine!r}")
        if self.gguf_activations not in ("auto", "int8", "fp32"):
            raise SettingsError(f"gguf_activations must be auto, int8 or fp32, got {self.gguf_activations!r}")
        if self.prefix_isolation not in ("shared", "key"):
            raise SettingsError(f"prefix_isolation must be shared or key, got {self.prefix_isolation!r}")
        if self.kv_dtype not in ("auto", "fp32", "f16"):
            raise SettingsError(f"kv_dtype must be auto, fp32 or f16, got {self.kv_dtype!r}")
        if self.degrade not in ("off", "int8"):
            raise SettingsError(f"degrade must be off or int8, got {self.degrade!r}")
        if self.degrade == "int8" and self.gguf_activations == "int8":
            raise SettingsError(
                "degrade=int8 switches fp32 rows to int8 ones at run time, and gguf_activations=int8 makes them int8 "
                "from the start: set one of them"
            )
        if self.device not in ("auto", "cpu", "cuda", "mps") and not self.device.startswith("cuda:"):
            raise SettingsError(f"device must be auto, cpu, cuda, cuda:N or mps, got {self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise SettingsError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.log_format not in ("json", "console"):
            raise SettingsError(f"log_format must be json or console, got {self.log_format!r}")
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise SettingsError(f"log_level must be debug, info, warning or error, got {self.log_level!r}")
        if self.redis_url is not None and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            # Not quoted: a Redis URL may carry a password.
            raise SettingsError("redis_url must start with redis://, rediss:// or unix://")
        try:
            parse_targets(self.sla_ms)
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
        if not -1 <= self.high_reserved_slots < self.max_concurrency:
            raise SettingsError(
                f"high_reserved_slots must be -1 (auto) or 0 to {self.max_concurrency - 1} (below max_concurrency), "
                f"got {self.high_reserved_slots}"
            )
        if not -1 <= self.high_extra_slots <= self.max_concurrency:
            raise SettingsError(
                f"high_extra_slots must be -1 (auto) or 0 to {self.max_concurrency} (max_concurrency), "
                f"got {self.high_extra_slots}"
            )
        if self.allowed_hosts is not None:
            try:
                parse_hosts(self.allowed_hosts)
            except ValueError as exc:
                raise SettingsError(str(exc)) from None
        if self.api_keys:
            from ttft_sse.admission.auth import parse_keys

            try:
                parse_keys(self.api_keys)
            except ValueError as exc:
                raise SettingsError(str(exc)) from None

    @property
    def chat_origin_set(self) -> frozenset[str]:
        """``chat_origins`` as the lower-case origins (no trailing slash) it lists."""
        entries = (entry.strip().lower().rstrip("/") for entry in (self.chat_origins or "").split(","))
        return frozenset(entry for entry in entries if entry)

    @property
    def reserved_slots(self) -> int:
        """The slots of ``max_concurrency`` kept for the high lane: ``high_reserved_slots``, none for -1."""
        return max(0, self.high_reserved_slots)

    @property
    def extra_slots(self) -> int:
        """Rows a step computes past ``max_concurrency``: ``high_extra_slots``, or for -1 half of
        ``max_concurrency`` (at least 1) where a high target is set."""
        if self.high_extra_slots >= 0:
            return self.high_extra_slots
        return max(1, self.max_concurrency // 2) if Lane.HIGH in parse_targets(self.sla_ms) else 0

    @property
    def engine_rows(self) -> int:
        """Rows a step of the batched engine computes: ``max_concurrency`` and the high lane's extra slots."""
        return self.max_concurrency + self.extra_slots

    @functools.cached_property
    def cores(self) -> int:
        """The cores this process may use (:func:`usable_cores`: affinity and cgroup quota), the one count behind
        every default that depends on them; read once, at the first use."""
        return usable_cores(CGROUP_CPU_MAX)

    @property
    def torch_threads(self) -> int:
        return self.threads or auto_threads(self.cores)

    @property
    def helper_threads(self) -> int:
        """The block kernel's helper threads: ``kernel_helpers``, or for -1 one where the process may use two cores
        or more (figures: docs/engine.md)."""
        if self.kernel_helpers >= 0:
            return self.kernel_helpers
        return 1 if self.cores >= 2 else 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Build settings from ``TTFT_*`` variables, then apply non-None ``overrides`` (CLI flags win)."""
        env = os.environ if environ is None else environ
        hints = get_type_hints(cls)
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is not None:
                values[f.name] = _parse(f.name, raw, hints[f.name])
        unknown = sorted(k for k in env if k.startswith(ENV_PREFIX) and k[len(ENV_PREFIX) :].lower() not in hints)
        if unknown:
            raise SettingsError(f"unknown setting(s) {', '.join(unknown)}; see docs/settings.md")
        values.update({k: v for k, v in overrides.items() if v is not None})
        if values.get("allowed_hosts") is None:  # where it listens is known here: the default follows it
            values["allowed_hosts"] = default_allowed_hosts(values.get("host", cls.host))
        return cls(**values)

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)


def _parse(name: str, raw: str, kind: Any) -> Any:
    var = ENV_PREFIX + name.upper()
    text = raw.strip()
    if kind is bool:
        lowered = text.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise SettingsError(f"{var} must be true or false, got {raw!r}")
    if kind is int:
        try:
            return int(text)
        except ValueError:
            raise SettingsError(f"{var} must be an integer, got {raw!r}") from None
    if kind is float:
        try:
            return float(text)
        except ValueError:
            raise SettingsError(f"{var} must be a number, got {raw!r}") from None
    if kind is Path:
        return Path(text).expanduser()
    if kind == (str | None):
        return text or None
    return text
