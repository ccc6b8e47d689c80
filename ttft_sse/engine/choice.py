"""Which engine serves the model: the one ``TTFT_ENGINE`` names, or for ``auto`` the faster of the batched engine and
the llama.cpp engine on this model file, measured once and remembered.

The measurement (:func:`_measure`) loads each engine in turn and runs, through the engine interface, a greedy decode of
48 tokens alone (c=1: tokens a second of one stream) and eight streams of 48 at once (c=8: tokens a second of all of
them, their prompts included). The engine faster at both wins; where each wins one, the one with the larger product
of the two. The verdict is written into the model's folder in the cache directory (its folder is keyed by the GGUF
file's size and bytes, engine/loading/sources.py), with what it depends on: the CPU, the threads, the concurrency,
the llama-cpp-python version and the block kernel's build. A later start with the same ones reads it and measures
nothing; ``ttft-sse prepare`` with ``TTFT_ENGINE=auto`` measures ahead of the first start.

``auto`` needs no measurement where only one engine can run: a model that is not a GGUF, or llama-cpp-python not
installed, gives the batched engine (``chosen_by`` says why); and where the machine's memory holds the KV cache asked
for beside one engine's weights and not the other's (engine/loading/budget.py: the batched engine's keys and values
in the dtype ``TTFT_KV_DTYPE`` gives them, f16 on llama.cpp's), that one runs (``chosen_by`` "memory"). An explicit
``TTFT_ENGINE`` always wins. ``/readyz`` and the start-up log say which engine runs and why (:func:`report`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import platform
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import structlog

from ttft_sse.engine.base import (
    ChatMessage,
    Engine,
    Finished,
    Hold,
    ModelInfo,
    Piece,
    Progress,
    Prompt,
    SamplingParams,
    StoresPrefixes,
    keep_warm,
)
from ttft_sse.engine.cache_files import write_whole
from ttft_sse.engine.kernels import compiler, kernel
from ttft_sse.engine.loading import budget, sources
from ttft_sse.settings import Settings
from ttft_sse.stages import StageClock

log = structlog.get_logger("ttft_sse.engine")

Item = Progress | Piece | Finished

CANDIDATES = ("batched", "llamacpp")
VERDICT_STEM = "engine-choice"
VERDICT_FORMAT = 2
"""Bump when the measurement changes, so that verdicts taken by another one are taken again."""
MEASURE_PROMPTS = (
    "Tell me a long story about a robot who learns to paint.",
    "Explain how a bicycle works, step by step.",
    "Write a poem about the sea at night.",
    "Describe a day in the life of a baker.",
    "What are the planets of the solar system? Describe each.",
    "Give me ten tips for learning a new language.",
    "Explain photosynthesis to a child.",
    "Describe the history of the printing press.",
)
ALONE_TOKENS = 48
TOGETHER_TOKENS = 48
TOGETHER = 8

Rates = dict[str, float]  # {"c1": tokens/s, "c8": tokens/s}
Measure = Callable[[Settings, str], Rates]


@dataclass(frozen=True)
class Choice:
    """Which engine runs, and why (``/readyz``'s ``engine``)."""

    name: str
    chosen_by: str  # "setting", "measured", "measured before", "only candidate", or "memory"
    reason: str = ""
    tokens_per_second: dict[str, Rates] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {"name": self.name, "chosen_by": self.chosen_by}
        if self.reason:
            body["reason"] = self.reason
        if self.tokens_per_second:
            body["tokens_per_second"] = self.tokens_per_second
        return body


def create_engine(settings: Settings, name: str | None = None) -> Engine:
    """The engine ``name`` (default ``settings.engine``) names; ``auto`` gives an :class:`AutoEngine`."""
    name = name or settings.engine
    if name == "auto":
        return AutoEngine(settings)
    if name == "llamacpp":
        from ttft_sse.engine.llamacpp.engine import LlamaCppEngine

        return LlamaCppEngine(settings)
    if name == "single":
        from ttft_sse.engine.single import SingleEngine

        return SingleEngine(settings)
    from ttft_sse.engine.batched.engine import BatchedEngine

    return BatchedEngine(settings)


def report(engine: Engine) -> dict[str, Any]:
    """``/readyz``'s ``engine``: the choice of an :class:`AutoEngine`, else the engine the setting named."""
    if isinstance(engine, AutoEngine):
        return engine.choice.as_dict()
    return Choice(engine.info.engine or type(engine).__name__, "setting").as_dict()


def choose(settings: Settings, *, measure: Measure | None = None) -> Choice:
    """The engine ``auto`` runs for ``settings.model``: from the remembered verdict, else measured (seconds; blocks)
    and remembered."""
    from ttft_sse.engine.llamacpp import library

    source = sources.resolve(settings.model)
    if source.kind != "gguf":
        return Choice("batched", "only candidate", f"the llama.cpp engine serves GGUF files, this is a {source.kind}")
    if library.installed() != library.VERSION:
        return Choice(
            "batched",
            "only candidate",
            f"{library.DISTRIBUTION}=={library.VERSION} is not installed (pip install 'ttft-sse[llamacpp]')",
        )
    fits = _fitting(settings, source)
    if len(fits) == 1:
        return fits[0]
    conditions = _conditions(settings)
    path = verdict_path(settings, conditions)
    remembered = _read(path, conditions)
    if remembered is not None:
        return remembered
    rates = {name: (measure or _measure)(settings, name) for name in CANDIDATES}
    choice = decide(rates)
    _write(path, conditions, choice)
    return choice


def _fitting(settings: Settings, source: sources.ModelSource) -> list[Choice]:
    """Where the memory plans (engine/loading/budget.py) let one candidate hold the KV cache asked for and the other
    not (the transformers engines hold it in TTFT_KV_DTYPE's dtype, llama.cpp in f16; a plan that cannot fit at all
    is refused), that one alone, with the reason; else both candidates (an empty reason each)."""
    import transformers

    location = sources.materialize(source, settings.cache_dir, StageClock())
    config = transformers.AutoConfig.from_pretrained(location)
    plans = {
        "batched": budget.for_transformers(settings, "gguf", location, source.location, config, "float32", True)[0],
        "llamacpp": budget.for_llama_cpp(settings, source.location, config),
    }
    whole = [name for name, plan in plans.items() if plan.refusal is None and plan.kv_tokens == plan.asked_tokens]
    if len(whole) != 1:
        return [Choice(name, "") for name in CANDIDATES]
    other = next(name for name in CANDIDATES if name != whole[0])
    held = plans[other]
    short = "cannot start" if held.refusal else f"would hold {held.kv_tokens} of its {held.asked_tokens} KV tokens"
    reason = f"memory: {other} {short} in {held.available / budget.GIB:.1f} GiB ({held.limit_from})"
    return [Choice(whole[0], "memory", reason)]


def verdict_path(settings: Settings, conditions: dict[str, Any] | None = None) -> Path:
    """Where the verdict for ``settings.model`` (a GGUF) under ``conditions`` (default: this machine's) is kept: in
    the model's converted folder, one file per set of conditions."""
    conditions = conditions or _conditions(settings)
    digest = hashlib.sha256(json.dumps(conditions, sort_keys=True).encode()).hexdigest()[:12]
    gguf = Path(sources.resolve(settings.model).location)
    return sources.model_dir(gguf, settings.cache_dir) / f"{VERDICT_STEM}-{digest}.json"


def decide(rates: dict[str, Rates]) -> Choice:
    """The faster engine at both c=1 and c=8; where each wins one, the larger product of the two rates."""
    a, b = CANDIDATES
    wins = {name: sum(rates[name][c] > rates[other][c] for c in ("c1", "c8")) for name, other in ((a, b), (b, a))}
    if wins[a] != wins[b]:
        name = a if wins[a] > wins[b] else b
        reason = "faster at c=1 and at c=8" if max(wins.values()) == 2 else "faster at one, as fast at the other"
    else:
        product = {name: rates[name]["c1"] * rates[name]["c8"] for name in CANDIDATES}
        name = a if product[a] >= product[b] else b
        reason = "faster at one of c=1 and c=8, and by more than it is slower at the other"
    return Choice(name, "measured", reason, {k: {c: round(v, 1) for c, v in r.items()} for k, r in rates.items()})


def _conditions(settings: Settings) -> dict[str, Any]:
    from ttft_sse.engine.llamacpp import library

    return {
        "format": VERDICT_FORMAT,
        "cpu": _cpu(),
        # The model name alone can be the same on CPUs with other features ("AMD EPYC" with and without AVX-512).
        "cpu_features": hashlib.sha256(compiler.cpu_features()).hexdigest()[:16],
        "cores": settings.cores,
        "threads": settings.torch_threads,
        "max_concurrency": settings.max_concurrency,
        "llama_cpp_python": library.installed(),
        # The batched engine's speed is mostly its block kernel's: another kernel (an upgrade), another measurement.
        "kernel": _kernel_key(),
    }


def _kernel_key() -> str | None:
    """The block kernel's build key on this machine, or None where no C compiler is on PATH (no kernel either)."""
    try:
        return compiler.key(kernel.SOURCES)
    except RuntimeError:
        return None


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _read(path: Path, conditions: dict[str, Any]) -> Choice | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("conditions") != conditions:
        return None
    choice = doc.get("choice", {})
    if choice.get("name") not in CANDIDATES:
        return None
    return Choice(choice["name"], "measured before", choice.get("reason", ""), choice.get("tokens_per_second", {}))


def _write(path: Path, conditions: dict[str, Any], choice: Choice) -> None:
    """Keep the verdict; a cache directory that cannot be written means measuring again at the next start."""
    text = json.dumps({"conditions": conditions, "choice": asdict(choice)}, indent=2)

    def write(partial: Path) -> None:
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(text)

    write_whole(path, write, "engine_choice_not_written")


def _measure(settings: Settings, name: str) -> Rates:
    """Load engine ``name`` and time it (see the module's docstring); the engine is closed after."""
    engine = create_engine(settings.replace(engine=name), name)
    started = time.perf_counter()
    engine.load(StageClock())
    rates = asyncio.run(_rates(engine, min(TOGETHER, settings.max_concurrency)))
    log.info("engine_measured", engine=name, seconds=round(time.perf_counter() - started, 1), **rates)
    return rates


async def _rates(engine: Engine, together: int) -> Rates:
    try:
        prompts = [engine.prepare(prompt=text, messages=None, raw=False) for text in MEASURE_PROMPTS[:together]]
        await _run(engine, prompts[0], 4)  # first calls: caches, lazy set-up
        alone = await _run(engine, prompts[0], ALONE_TOKENS)
        c1 = (alone.usage.completion_tokens - 1) / max(alone.timings["decode_ms"] / 1000, 1e-6)
        started = time.perf_counter()
        results = await asyncio.gather(*(_run(engine, prompt, TOGETHER_TOKENS) for prompt in prompts))
        c8 = sum(r.usage.completion_tokens for r in results) / (time.perf_counter() - started)
        return {"c1": c1, "c8": c8}
    finally:
        await engine.close()


async def _run(engine: Engine, prompt: Prompt, tokens: int) -> Finished:
    async with aclosing(engine.stream(prompt, SamplingParams(max_tokens=tokens))) as items:
        async for item in items:
            if isinstance(item, Finished):
                return item
    raise RuntimeError("the engine ended a measuring stream without a Finished")


class AutoEngine:
    """``TTFT_ENGINE=auto``: at load, the choice (:func:`choose`), then the chosen engine loaded; everything else is
    the chosen engine's (attributes it has beyond the interface, such as ``stats``, are read through)."""

    def __init__(self, settings: Settings, *, measure: Measure | None = None) -> None:
        self._settings = settings
        self._measure = measure
        self._engine: Engine | None = None
        self._choice: Choice | None = None

    @property
    def choice(self) -> Choice:
        if self._choice is None:
            raise RuntimeError("AutoEngine.choice is read before load()")
        return self._choice

    @property
    def chosen(self) -> Engine:
        if self._engine is None:
            raise RuntimeError("AutoEngine.chosen is read before load(); await the lifespan's readiness first")
        return self._engine

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or self._engine is None:
            raise AttributeError(name)
        return getattr(self._engine, name)

    @property
    def info(self) -> ModelInfo:
        return self.chosen.info

    @property
    def active(self) -> int:
        return self._engine.active if self._engine is not None else 0

    @property
    def mode(self) -> str:
        return self.chosen.mode

    def set_mode(self, mode: str) -> None:
        self.chosen.set_mode(mode)

    def load(self, clock: StageClock) -> None:
        with clock.stage("engine_choice"):
            self._choice = choice = choose(self._settings, measure=self._measure)
        log.info("engine_chosen", **choice.as_dict())
        engine = create_engine(self._settings.replace(engine=choice.name), choice.name)
        engine.load(clock)
        self._engine = engine

    def prepare(
        self, *, prompt: str | None, messages: Sequence[ChatMessage] | None, raw: bool, parse_special: bool = False
    ) -> Prompt:
        return self.chosen.prepare(prompt=prompt, messages=messages, raw=raw, parse_special=parse_special)

    async def stream(self, prompt: Prompt, params: SamplingParams) -> AsyncGenerator[Item, None]:
        async with aclosing(self.chosen.stream(prompt, params)) as items:
            async for item in items:
                yield item

    def prepare_prefix(self, *, prompt: str | None, messages: Sequence[ChatMessage] | None, raw: bool) -> Prompt:
        return self.chosen.prepare_prefix(prompt=prompt, messages=messages, raw=raw)

    def cached(self, prompt: Prompt, cache_salt: str = "") -> int:
        return self.chosen.cached(prompt, cache_salt)

    async def prefill(self, prompt: Prompt, *, cache_salt: str = "", owner: str = "", hold: Hold = None) -> int:
        return await self.chosen.prefill(prompt, cache_salt=cache_salt, owner=owner, hold=hold)

    async def warm(self, prompt: Prompt) -> int:
        return await keep_warm(self.chosen, prompt)

    async def store_prefixes(self) -> None:
        """The chosen engine's, where it keeps prefixes across a restart (the single engine does not): said here, not
        read through, since a protocol check need not look through ``__getattr__``."""
        if isinstance(self._engine, StoresPrefixes):
            await self._engine.store_prefixes()

    async def restore_prefixes(self) -> None:
        if isinstance(self._engine, StoresPrefixes):
            await self._engine.restore_prefixes()

    async def close(self) -> None:
        if self._engine is not None:
            await self._engine.close()
