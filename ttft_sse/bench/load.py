"""The load phase: every arm (a target spoken to in one mode) at every concurrency level.

Schedule. With one arm, ``c`` workers send requests back to back (a closed loop: each worker sends its next request
when the last one ends), so the server always has ``c`` requests in flight. With two arms or more — two ``--url``s,
or ``--mode stream,batch`` — arms take turns in rounds: a round sends ``c`` requests at once to one arm and waits
for them, then the next arm gets the same ``c`` prompts; the arm that goes first rotates every round. Only one arm
is loaded at a time (two servers on one machine would otherwise take each other's cores), each arm sees exactly
``c`` requests in flight, and slow drifts in machine noise (someone else's build starting) fall on every arm alike,
so the ratio between arms is taken under the same conditions. Compare arms of the same run with each other; compare
a one-arm run's figures with another one-arm run's.

What each request sends: request *i* of a level takes prompt *i* modulo the prompt set, asks for
``max_tokens.at(i)`` (:class:`~ttft_sse.bench.protocol.Lengths`), and, with a ``prompt_tag``, is a new conversation
(:meth:`~ttft_sse.bench.prompts.Prompt.tagged` with ``<prompt_tag>-<c>-<i>``, and ``-<n>`` for the second and later arm
of one URL), so that no request repeats one a server has seen: not at another level, not in another arm on the same
server. Arms on different URLs get the very same prompts, so that their figures compare.

With ``typing_cps`` (``--typing-cps``), each request's last message is typed first, with ``/prefill`` called as the
chat page calls it (:mod:`ttft_sse.bench.typist`); the request goes when typing ends, and its times count from then.

Every loop is bounded: by ``--requests`` per arm and level, or by ``--duration`` of active time per arm and level
(requests in flight at the deadline finish and are counted); each request by its timeout.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from ttft_sse.bench.client import Record, Target, send
from ttft_sse.bench.prompts import Prompt
from ttft_sse.bench.protocol import Lengths, Mode
from ttft_sse.bench.typist import type_out


@dataclass(frozen=True)
class Plan:
    targets: tuple[Target, ...]
    modes: tuple[Mode, ...]
    concurrency: tuple[int, ...]
    prompts: tuple[Prompt, ...]
    max_tokens: Lengths
    requests: int | None = None  # per arm and level; exactly one of requests and duration_s is set
    duration_s: float | None = None
    timeout_s: float = 300.0
    prompt_tag: str | None = None  # None: send the prompts as written
    typing_cps: float = 0.0  # above 0: type each request's last message at this speed first (native targets only)

    def prompt(self, target: Target, mode: Mode, concurrency: int, index: int) -> Prompt:
        """What request ``index`` of an arm sends at a level (the module's docstring says how it is chosen)."""
        prompt = self.prompts[index % len(self.prompts)]
        if self.prompt_tag is None:
            return prompt
        same_url = [arm for arm in self.arms if arm[0].url == target.url]
        nth = same_url.index((target, mode))
        return prompt.tagged(f"{self.prompt_tag}-{concurrency}-{index}" + (f"-{nth}" if nth else ""))

    def __post_init__(self) -> None:
        if (self.requests is None) == (self.duration_s is None):
            raise ValueError("give either requests or duration_s")
        if not (self.targets and self.modes and self.concurrency and self.prompts):
            raise ValueError("a plan needs targets, modes, concurrency levels and prompts")
        if self.typing_cps < 0:
            raise ValueError("typing_cps must be 0 (no typing) or more")
        if self.typing_cps and any(t.protocol != "native" for t in self.targets):
            raise ValueError("typing calls /prefill, which only native targets have")

    @property
    def arms(self) -> list[tuple[Target, Mode]]:
        return [(target, mode) for target in self.targets for mode in self.modes]

    @property
    def planned(self) -> int | None:
        """How many requests the plan sends, when that is known in advance (``--requests``)."""
        if self.requests is None:
            return None
        return self.requests * len(self.arms) * len(self.concurrency)


@dataclass
class ArmRun:
    """What one arm did at one concurrency level."""

    target: Target
    mode: Mode
    concurrency: int
    records: list[Record] = field(default_factory=list)
    active_s: float = 0.0


Progress = Callable[[Record], None]


def client_for(plan: Plan) -> httpx.AsyncClient:
    most = max(plan.concurrency) * (2 if plan.typing_cps else 1)  # a typist's prefills may overlap its request
    return httpx.AsyncClient(
        timeout=httpx.Timeout(plan.timeout_s, connect=min(10.0, plan.timeout_s)),
        limits=httpx.Limits(max_connections=most + 1, max_keepalive_connections=most + 1),
    )


async def run(plan: Plan, *, epoch: float, progress: Progress | None = None) -> list[ArmRun]:
    """Run the plan, level by level; returns one :class:`ArmRun` per arm and level, in that order."""
    runs: list[ArmRun] = []
    clients = {target.label: client_for(plan) for target in plan.targets}  # one pool per target
    try:
        for c in plan.concurrency:
            level = [ArmRun(target, mode, c) for target, mode in plan.arms]
            sender = _Sender(plan, clients, epoch, progress)
            if len(level) == 1:
                await _continuous(level[0], sender)
            else:
                await _rounds(level, sender)
            runs.extend(level)
    finally:
        for client in clients.values():
            await client.aclose()
    return runs


@dataclass
class _Sender:
    plan: Plan
    clients: dict[str, httpx.AsyncClient]
    epoch: float
    progress: Progress | None

    async def send(self, arm: ArmRun, index: int) -> None:
        target = arm.target
        prompt = self.plan.prompt(target, arm.mode, arm.concurrency, index)
        record = Record(target.label, target.protocol, arm.mode, arm.concurrency, index, prompt.name)
        client = self.clients[target.label]
        typed = None
        if self.plan.typing_cps:
            session = f"bench-{arm.concurrency}-{index}-{secrets.token_hex(3)}"  # one tab per typist
            messages = prompt.as_messages()
            typed = await type_out(
                client, target.url, messages, self.plan.typing_cps, session=session, headers=target.headers
            )
        await send(
            client,
            target,
            arm.mode,
            prompt,
            max_tokens=self.plan.max_tokens.at(index),
            record=record,
            epoch=self.epoch,
        )
        if typed is not None:
            await typed.settled()
            record.prefills, record.prefills_failed = typed.accepted, typed.failed
        arm.records.append(record)
        if self.progress is not None:
            self.progress(record)


async def _continuous(arm: ArmRun, sender: _Sender) -> None:
    plan = sender.plan
    started = time.perf_counter()
    deadline = started + plan.duration_s if plan.duration_s is not None else None
    issued = 0

    def take() -> int | None:
        nonlocal issued
        if plan.requests is not None and issued >= plan.requests:
            return None
        if deadline is not None and time.perf_counter() >= deadline:
            return None
        issued += 1
        return issued - 1

    async def worker() -> None:
        while (index := take()) is not None:
            await sender.send(arm, index)

    await asyncio.gather(*(worker() for _ in range(arm.concurrency)))
    arm.active_s = time.perf_counter() - started


async def _rounds(arms: list[ArmRun], sender: _Sender) -> None:
    plan = sender.plan
    c = arms[0].concurrency
    round_no = 0
    while True:
        first = round_no * c
        if plan.requests is not None:
            if first >= plan.requests:
                return
            indices = range(first, min(first + c, plan.requests))
        else:
            assert plan.duration_s is not None
            if min(arm.active_s for arm in arms) >= plan.duration_s:
                return
            indices = range(first, first + c)
        for k in range(len(arms)):
            arm = arms[(round_no + k) % len(arms)]
            started = time.perf_counter()
            await asyncio.gather(*(sender.send(arm, i) for i in indices))
            arm.active_s += time.perf_counter() - started
        round_no += 1


async def discover_model(target: Target, *, timeout_s: float = 10.0) -> str:
    """The first model an OpenAI-compatible server lists at ``/v1/models`` (vLLM wants its exact name)."""
    url = target.url
    async with httpx.AsyncClient(timeout=timeout_s, headers=target.headers) as client:
        try:
            response = await client.get(url.rstrip("/") + "/v1/models")
            models = response.json()["data"]
            name = models[0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            raise LookupError(
                f"could not read the model name from {url}/v1/models ({type(exc).__name__}); pass --model NAME"
            ) from None
    return str(name)
