"""The prefill process (engine/first/process.py): the first tokens it gives are the single engine's, the batched
engine
races it against its own step without repeating or losing a token, and a child that dies or is stopped leaves
every request answered.

Which of the two gives a request its first token depends on timing; the texts must not. The tests read which one
won from ``stats()`` and assert the texts against the single-request engine's either way.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable, Iterator
from contextlib import aclosing
from typing import Any

import pytest
from structlog.testing import capture_logs

from tests.support.engines import collect, eventually_idle, prompt_of
from tests.support.servers import eventually
from tests.support.texts import QUESTIONS, SYSTEM
from ttft_sse.engine.base import Finished, Prompt, SamplingParams
from ttft_sse.engine.batched.engine import BatchedEngine
from ttft_sse.engine.first.process import NEW_TOKENS, PrefillProcess, Prefixes, first_tokens, last_logits, learn
from ttft_sse.engine.single import SingleEngine
from ttft_sse.settings import Settings
from ttft_sse.stages import StageClock

# Whether the prefill process wins a race for a first token depends on its getting a core in time: the tests that
# ask it to win send new bursts of prompts, up to this many, until it has (tests/integration/test_prefill_server.py
# does the same). Alone it wins the first burst; in one full run of the suite, on a day the machine ran it 1.8x
# slower, it lost 4 in a row.
RACE_BURSTS = 8

"""A long system prompt: ~100 tokens, more than the child computes for a first token when it is new to it."""


class FakeCache:
    """Counts the tokens a cache would hold; ``crop`` takes a negative count, as transformers' DynamicCache."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens

    def crop(self, count: int) -> None:
        assert count < 0
        self.tokens += count


def fresh() -> FakeCache:
    return FakeCache(0)


def test_prefixes_reuse_the_longest_shared_prefix_short_of_the_last_token() -> None:
    prefixes = Prefixes()
    cache, shared = prefixes.take((1, 2, 3), fresh)
    assert (shared, cache.tokens) == (0, 0)
    prefixes.keep((1, 2, 3, 4, 5), FakeCache(5))
    prefixes.keep((1, 2, 9), FakeCache(3))
    cache, shared = prefixes.take((1, 2, 3, 4, 6), fresh)
    assert (shared, cache.tokens) == (4, 4)
    # The same prompt again: all but its last token (whose logits give the first token).
    cache, shared = prefixes.take((1, 2, 3, 4, 5), fresh)
    assert (shared, cache.tokens) == (4, 4)
    # Taking copied: the kept cache still holds its 5 tokens.
    cache, shared = prefixes.take((1, 2, 3, 4, 5, 6), fresh)
    assert (shared, cache.tokens) == (5, 5)
    cache, shared = prefixes.take((7, 1, 2), fresh)
    assert (shared, cache.tokens) == (0, 0)


def test_prefixes_are_bounded_by_entries_and_tokens_least_recently_used_first() -> None:
    prefixes = Prefixes(entries=2, tokens=100)
    prefixes.keep((1, 2, 3), FakeCache(3))
    prefixes.keep((4, 5, 6), FakeCache(3))
    prefixes.take((1, 2, 3, 9), fresh)  # (1, 2, 3) is now the most recently used
    prefixes.keep((7, 8), FakeCache(2))
    assert len(prefixes) == 2
    assert prefixes.take((4, 5, 6, 9), fresh)[1] == 0
    assert prefixes.take((1, 2, 3, 9), fresh)[1] == 3

    by_tokens = Prefixes(entries=10, tokens=5)
    by_tokens.keep((1, 2, 3), FakeCache(3))
    by_tokens.keep((4, 5, 6), FakeCache(3))
    assert len(by_tokens) == 1
    assert by_tokens.take((1, 2, 3, 9), fresh)[1] == 0
    assert by_tokens.take((4, 5, 6, 9), fresh)[1] == 3


def test_a_prompt_is_kept_in_place_of_its_own_beginning_and_known_counts_what_take_gives() -> None:
    prefixes = Prefixes()
    prefixes.keep((1, 2), FakeCache(2))
    prefixes.keep((1, 2, 3, 4), FakeCache(4))  # (1, 2) goes: whatever it shares with a prompt, this shares too
    prefixes.keep((1, 5), FakeCache(2))  # not a beginning of (1, 2, 3, 4): both stay
    assert len(prefixes) == 2
    assert prefixes.known((1, 2, 3, 4, 9)) == prefixes.take((1, 2, 3, 4, 9), fresh)[1] == 4
    assert prefixes.known((1, 2, 3, 4)) == 3  # all but the last token
    assert prefixes.known((1, 5, 6)) == 2 and prefixes.known((7, 8)) == 0


def first_token(engine: SingleEngine, prompt: Prompt) -> int:
    import torch

    with torch.inference_mode():
        logits = engine.model(input_ids=torch.tensor([list(prompt.token_ids)])).logits
    return int(logits[0, -1].argmax())


def prompts(engine: SingleEngine | BatchedEngine, label: str = "") -> list[Prompt]:
    """The questions, each after ``label``: a test's own prompts, which the batch has no prefix of yet."""
    return [engine.prepare(prompt=f"{label}{q}", messages=None, raw=False) for q in QUESTIONS]


def test_rows_behind_a_cached_prefix_and_side_by_side_come_out_as_a_whole_prompt_does(reference: SingleEngine) -> None:
    """The child's forward passes (a prompt's new rows behind a cached prefix, several prompts side by side, padded)
    give each prompt's last row the same logits, bit for bit, as the prompt computed whole: every call takes the C
    attention (a mask of new rows behind a prefix is recognised as causal) and each row depends on its own inputs
    alone. Were any of them SDPA's, the sums would be ordered otherwise and the bits would differ."""
    import torch
    import transformers

    model = reference.model
    a, b = (p.token_ids for p in prompts(reference)[:2])
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert shared > 4

    def last_logits(ids: list[list[int]], cache: Any, last: list[int]) -> Any:
        with torch.inference_mode():
            hidden = model.base_model(input_ids=torch.tensor(ids), cache=cache, use_cache=True).last_hidden_state
            return model.get_output_embeddings()(hidden[torch.arange(len(ids)), torch.tensor(last)])

    def prefix() -> Any:
        cache = transformers.DynamicCache(config=model.config)
        last_logits([list(a[:shared])], cache, [shared - 1])
        return cache

    whole = [last_logits([list(p)], None, [len(p) - 1])[0] for p in (a, b)]
    behind = last_logits([list(a[shared:])], prefix(), [len(a) - shared - 1])[0]
    assert torch.equal(behind, whole[0])
    cache = prefix()
    cache.batch_repeat_interleave(2)
    longest = max(len(a), len(b))
    padded = [[*p[shared:], *[p[-1]] * (longest - len(p))] for p in (a, b)]
    together = last_logits(padded, cache, [len(p) - shared - 1 for p in (a, b)])
    assert torch.equal(together[0], whole[0]) and torch.equal(together[1], whole[1])


def test_a_prompt_learned_a_chunk_at_a_time_gives_the_logits_of_the_whole_prompt(reference: SingleEngine) -> None:
    import torch

    model = reference.model
    ids = prompt_of(reference, "Can I take my bicycle?", SYSTEM).token_ids
    prefixes = Prefixes()
    chunks = 1
    while not learn(model, torch, prefixes, ids, rows=16):
        chunks += 1
    assert chunks == -(-(len(ids) - 1) // 16)  # 16 rows a chunk up to all but the last token
    assert len(prefixes) == 1 and prefixes.known(ids) == len(ids) - 1  # one entry, grown a chunk at a time
    with torch.inference_mode():
        whole = model.get_output_embeddings()(model.base_model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1])
    assert torch.equal(last_logits(model, torch, prefixes, [ids])[0], whole)


@pytest.fixture(scope="module")
def child(settings: Settings) -> Iterator[PrefillProcess]:
    process = PrefillProcess(settings.replace(prefill_process=True, prefill_between_layers=False, kernel_helpers=0))
    process.start()
    eventually(lambda: process.state != "loading", timeout=180)
    yield process
    process.stop()


async def test_first_tokens_are_the_single_engines_with_and_without_a_shared_prefix(
    child: PrefillProcess, reference: SingleEngine
) -> None:
    assert child.state == "ready"
    served = child.served
    # Twice: the second time every prompt is known to the child (all but its last token reused); the first time
    # only the chat template's start is.
    for prompt in prompts(reference) * 2:
        assert await child.first_token(prompt.token_ids, lambda: True) == first_token(reference, prompt)
    assert child.served == served + 2 * len(QUESTIONS)


async def test_a_prompt_nobody_wants_any_more_is_not_computed(child: PrefillProcess, reference: SingleEngine) -> None:
    served = child.served
    assert await child.first_token(prompts(reference)[0].token_ids, lambda: False) is None
    assert child.served == served


async def test_the_child_declines_a_long_new_prompt_learns_it_and_then_answers_the_prompts_behind_it(
    child: PrefillProcess, reference: SingleEngine
) -> None:
    first = prompt_of(reference, "Can I take my dog?", SYSTEM)
    second = prompt_of(reference, "Is my seat reserved?", SYSTEM)
    assert len(first.token_ids) - len(prompts(reference)[0].token_ids) > NEW_TOKENS  # new past the template's start
    served = child.served
    assert await child.first_token(first.token_ids, lambda: True) is None  # declined at once: the batch gives it
    assert child.served == served
    # Learned while nothing waits: the next question behind the same system prompt is new by a few tokens only.
    for _ in range(100):
        token = await child.first_token(second.token_ids, lambda: True)
        if token is not None:
            break
        await asyncio.sleep(0.1)
    assert token == first_token(reference, second)
    assert child.served == served + 1


@pytest.fixture(scope="module")
def engine(settings: Settings) -> Iterator[BatchedEngine]:
    engine = BatchedEngine(settings.replace(prefill_process=True, prefill_between_layers=False, kernel_helpers=0))
    engine.load(StageClock())
    eventually(lambda: engine.stats().prefill != "loading", timeout=180)
    yield engine
    asyncio.run(engine.close())


async def test_requests_arriving_at_a_busy_batch_get_the_same_text_whoever_gives_the_first_token(
    engine: BatchedEngine, reference: SingleEngine
) -> None:
    assert engine.stats().prefill == "ready"
    params = SamplingParams(max_tokens=12)

    # Eight prompts at once: the batch prefills them in one step of ~300 rows, the child one prompt at a time
    # (~16 new rows each, behind the template's start it knows): it wins the first few, when it gets a core in time.
    async def burst(n: int) -> None:
        label = f"({n}) " if n else ""
        want = [await collect(reference.stream(p, params)) for p in prompts(reference, label)]
        with capture_logs() as logs:
            got = await asyncio.gather(*(collect(engine.stream(p, params)) for p in prompts(engine, label)))
        assert [text for text, _ in got] == [text for text, _ in want]
        assert [f.usage for _, f in got] == [f.usage for _, f in want]
        assert [f.finish_reason for _, f in got] == [f.finish_reason for _, f in want]
        assert not [e for e in logs if e["event"] == "first_token_mismatch"]

    await until_the_process_wins(engine, burst)


async def test_a_one_token_answer_from_the_prefill_process_ends_the_request(
    engine: BatchedEngine, reference: SingleEngine
) -> None:
    params = SamplingParams(max_tokens=1)

    async def burst(n: int) -> None:
        label = f"Briefly ({n}): "
        want = [await collect(reference.stream(p, params)) for p in prompts(reference, label)]
        got = await asyncio.gather(*(collect(engine.stream(p, params)) for p in prompts(engine, label)))
        assert [text for text, _ in got] == [text for text, _ in want]
        assert {(f.finish_reason, f.usage.completion_tokens) for _, f in got} == {("length", 1)}

    await until_the_process_wins(engine, burst)  # it gave a whole answer
    await eventually_idle(engine)


async def until_the_process_wins(engine: BatchedEngine, burst: Callable[[int], Awaitable[None]]) -> None:
    """Sends ``burst(0)``, ``burst(1)``, … (each its own new prompts, each checked by ``burst``) until the prefill
    process has given a first token, at most RACE_BURSTS: whether it wins a race depends on its getting a core in
    time, which on a loaded machine one burst may not give it."""
    before = engine.stats().side_first_tokens
    for n in range(RACE_BURSTS):
        await burst(n)
        if engine.stats().side_first_tokens > before:
            return
    raise AssertionError(f"the prefill process won no race in {RACE_BURSTS} bursts")


async def test_long_new_prompts_at_a_busy_batch_are_left_to_it_and_answered_whole(
    engine: BatchedEngine, reference: SingleEngine
) -> None:
    """Prompts the child declines (each behind a long system prompt of its own) get their first token from the
    batch, and the single engine's text."""
    before = engine.stats().side_first_tokens
    params = SamplingParams(max_tokens=6)
    asks = [(QUESTIONS[i], f"Case {i}. {SYSTEM}") for i in range(4)]
    want = [await collect(reference.stream(prompt_of(reference, *ask), params)) for ask in asks]
    with capture_logs() as logs:
        got = await asyncio.gather(*(collect(engine.stream(prompt_of(engine, *ask), params)) for ask in asks))
    assert [text for text, _ in got] == [text for text, _ in want]
    assert engine.stats().side_first_tokens == before
    assert not [e for e in logs if e["event"] in ("first_token_mismatch", "generation_failed")]
    await eventually_idle(engine)
    assert (engine._claims._open, engine._claims._side) == (set(), {})


async def test_sampled_requests_arriving_at_a_busy_batch_are_raced_too(engine: BatchedEngine) -> None:
    params = SamplingParams(max_tokens=4, temperature=1.0, top_p=0.95)

    async def burst(n: int) -> None:
        with capture_logs() as logs:
            got = await asyncio.gather(
                *(collect(engine.stream(p, params)) for p in prompts(engine, f"Sampled ({n}): "))
            )
        # Every answer whole: its 4 tokens, or up to 4 ending on the end-of-text token (unseeded sampling: 2 of 320
        # draws of these prompts on the single engine did, "Paris." and the end in 3 tokens, and the end as a 4th).
        ends = [(f.finish_reason, f.usage.completion_tokens) for _, f in got]
        assert all(end == ("length", 4) or (end[0] == "stop" and 1 <= end[1] <= 4) for end in ends), ends
        assert not [e for e in logs if e["event"] == "first_token_mismatch"]

    await until_the_process_wins(engine, burst)
    await eventually_idle(engine)


async def test_clients_that_leave_raced_requests_at_any_point_leave_nothing_behind(engine: BatchedEngine) -> None:
    """Greedy and sampled requests at a busy batch, half of whose clients leave: at once, after the first piece
    (often the process's), or after a few. Every slot is freed and no claim is left (a leak would grow with every
    client that leaves), and the whole answers are whole."""
    leave_after = [(None, 0, None, 1, None, 3)[i % 6] for i in range(18)]  # the sampled half leaves
    whole: dict[int, int] = {}

    async def one(i: int, burst: int) -> None:
        sampled = SamplingParams(12, temperature=1.0, top_p=0.9)
        params = sampled if i % 2 else SamplingParams(12)
        question = f"Leaving {i} ({burst}): {QUESTIONS[i % len(QUESTIONS)]}"
        prompt = engine.prepare(prompt=question, messages=None, raw=False)
        pieces = 0
        async with aclosing(engine.stream(prompt, params)) as items:
            async for item in items:
                if isinstance(item, Finished):
                    whole[i] = item.usage.completion_tokens
                elif leave_after[i] is not None and pieces >= leave_after[i]:
                    return
                else:
                    pieces += 1

    staying = {i for i in range(18) if leave_after[i] is None}

    async def burst(n: int) -> None:
        whole.clear()
        with capture_logs() as logs:
            await asyncio.wait_for(asyncio.gather(*(one(i, n) for i in range(18))), 120)
        await eventually_idle(engine)
        assert engine.stats().streams == 0
        assert (engine._claims._open, engine._claims._side) == (set(), {})
        # Every client that stayed got its whole answer. One that meant to leave after n pieces can only have had a
        # whole answer if its draw ended by then (unseeded sampling: rare, not impossible), the end-of-text token
        # counted but not shown.
        assert staying <= set(whole) and all(1 <= whole[i] <= 12 for i in staying)
        assert all(whole[i] <= (leave_after[i] or 0) + 1 for i in set(whole) - staying), whole
        assert not [e for e in logs if e["event"] in ("first_token_mismatch", "generation_failed")]

    await until_the_process_wins(engine, burst)  # it raced some of them


def test_the_child_draws_a_sampled_first_token_from_the_requests_top_p(reference: SingleEngine) -> None:
    import torch

    prompt = prompts(reference)[0]
    greedy = first_token(reference, prompt)
    generator = torch.Generator().manual_seed(0)
    # A top-p this small keeps the most probable token alone; at temperature 50 the distribution is nearly flat.
    asks = [(prompt.token_ids, 0.0, 1.0), (prompt.token_ids, 1.0, 1e-6), *[(prompt.token_ids, 50.0, 1.0)] * 6]
    tokens = first_tokens(reference.model, torch, Prefixes(), asks, generator, [])
    assert tokens[:2] == [greedy, greedy]
    assert len(set(tokens[2:])) > 1


class ScriptedProcess:
    """Stands in for the prefill process: gives every prompt it is asked for ``token``, at once (before any step of
    the batch can)."""

    token = 0
    state = "ready"
    pid = None

    def __init__(self, settings: Settings) -> None:
        self.served = 0

    def start(self) -> None:
        pass

    def stop(self, timeout: float = 5.0) -> None:
        pass

    async def first_token(
        self, token_ids: Any, wanted: Any, temperature: float = 0.0, top_p: float = 1.0
    ) -> int | None:
        if not wanted():
            return None
        self.served += 1
        return self.token


async def test_the_batch_goes_on_from_the_first_token_the_process_gave(
    settings: Settings, reference: SingleEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whichever token the process gives first, the client gets it and the batch goes on from it (its step is made
    to pick it): here a token the batch would not pick, so that the answer is the model's greedy continuation of
    the prompt and that token. Without the step picking it, the batch would go on from its own."""
    import torch

    from ttft_sse.engine.batched import engine as batched
    from ttft_sse.engine.first import beside

    monkeypatch.setattr(beside, "PrefillProcess", ScriptedProcess)  # started
    monkeypatch.setattr(batched, "PrefillProcess", ScriptedProcess)  # told apart from interludes
    forced = reference.tokenizer.encode(" Banana", add_special_tokens=False)[0]
    monkeypatch.setattr(ScriptedProcess, "token", forced)
    own = BatchedEngine(settings.replace(prefill_process=True, prefill_between_layers=False, kernel_helpers=0))
    own.load(StageClock())
    try:
        asked = prompts(own, "Forced: ")
        assert all(first_token(reference, p) != forced for p in asked)

        def forced_answer(prompt: Prompt) -> str:
            with torch.inference_mode():
                ids = torch.tensor([[*prompt.token_ids, forced]])
                out = reference.model.generate(input_ids=ids, max_new_tokens=5, do_sample=False)
            return str(reference.tokenizer.decode([forced, *out[0, ids.shape[1] :].tolist()], skip_special_tokens=True))

        params = SamplingParams(max_tokens=6)
        want = [(await collect(reference.stream(asked[0], params)))[0]] + [forced_answer(p) for p in asked[1:]]
        with capture_logs() as logs:
            got = await asyncio.gather(*(collect(own.stream(p, params)) for p in asked))
        # The first request found the batch idle (not raced); the seven others arrived while it was busy.
        assert [text for text, _ in got] == want
        assert own.prefill_process is not None and own.prefill_process.served == len(asked) - 1
        assert own.stats().side_first_tokens == len(asked) - 1
        assert not [e for e in logs if e["event"] == "first_token_mismatch"]
    finally:
        await own.close()


async def test_no_race_where_the_batchs_cache_does_not_read_in_place_and_close_stops_the_running_child(
    settings: Settings, reference: SingleEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model whose layers are not all full attention (sliding windows): its batched steps take the library's masked
    attention, whose bits the process's would not match. Simulated by a cache that refuses to read in place. The
    child runs all the same (ready, asked nothing), and the engine's close stops it."""
    from ttft_sse.engine.library import in_place

    monkeypatch.setattr(in_place, "reads_in_place", lambda cache: False)
    own = BatchedEngine(settings.replace(prefill_process=True, prefill_between_layers=False, kernel_helpers=0))
    own.load(StageClock())
    process = own.prefill_process
    assert process is not None and process.pid is not None
    try:
        eventually(lambda: own.stats().prefill != "loading", timeout=180)
        assert own.stats().prefill == "ready"
        params = SamplingParams(max_tokens=4)
        want = [(await collect(reference.stream(p, params)))[0] for p in prompts(reference, "Masked: ")]
        got = await asyncio.gather(*(collect(own.stream(p, params)) for p in prompts(own, "Masked: ")))
        assert [text for text, _ in got] == want
        assert own.stats().side_first_tokens == 0
        assert process.served == 0
        os.kill(process.pid, 0)  # still running
    finally:
        await own.close()
    assert own.stats().prefill == "stopped"
    with pytest.raises(ProcessLookupError):  # reaped: its PID is gone
        os.kill(process.pid, 0)


async def test_a_dead_child_leaves_every_request_answered_and_close_stops_it(
    settings: Settings, reference: SingleEngine
) -> None:
    own = BatchedEngine(settings.replace(prefill_process=True, prefill_between_layers=False, kernel_helpers=0))
    own.load(StageClock())
    process = own.prefill_process
    assert process is not None and process.pid is not None
    pid = process.pid
    eventually(lambda: own.stats().prefill != "loading", timeout=180)
    params = SamplingParams(max_tokens=8)
    want = [(await collect(reference.stream(p, params)))[0] for p in prompts(reference)]
    os.kill(pid, signal.SIGKILL)
    with capture_logs() as logs:
        got = await asyncio.gather(*(collect(own.stream(p, params)) for p in prompts(own)))
    assert [text for text, _ in got] == want
    assert own.stats().prefill == "failed"
    assert [e["reason"] for e in logs if e["event"] == "prefill_process_failed"] != []
    # Failed for good: the next requests do not ask it, and are answered.
    got = await asyncio.gather(*(collect(own.stream(p, params)) for p in prompts(own)))
    assert [text for text, _ in got] == want
    await own.close()
    assert own.stats().prefill == "stopped"
    with pytest.raises(ProcessLookupError):  # reaped: its PID is gone
        os.kill(pid, 0)


def test_no_prefill_process_when_it_is_off(settings: Settings) -> None:
    off = BatchedEngine(settings)  # the suite's settings: prefill_process=False
    assert off.prefill_process is None
    assert off.stats().prefill == "off"


@pytest.mark.parametrize(
    ("changes", "cores", "reason"),
    [
        # A process limited to one CPU (its affinity here; a container's CPU quota counts the same way).
        ({"kernel_helpers": 0}, 1, "one core only (affinity and CPU quota)"),
        # With the masked attention (a step's rows attend through one SDPA over the batch), a row's bits depend on
        # the batch: the process's first token could differ from the batch's.
        (
            {"kernel_helpers": 0, "paged_attention": False},
            2,
            "it needs the block kernel and the C attention (a GGUF model, on CPU, in fp32)",
        ),
        # Both want the second core, and the batch on two cores did better at c=8 (docs/engine.md).
        (
            {"kernel_helpers": 1},
            2,
            "the block kernel's helper threads use the other cores (TTFT_KERNEL_HELPERS=0 gives them to it)",
        ),
    ],
    ids=["one-core", "masked-attention", "kernel-helpers"],
)
async def test_no_prefill_process_where_it_would_not_help_and_the_log_says_why(
    settings: Settings, changes: dict[str, Any], cores: int, reason: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(cores)))
    engine = BatchedEngine(settings.replace(prefill_process=True, prefill_between_layers=False, **changes))
    with capture_logs() as logs:
        engine.load(StageClock())
    try:
        assert engine.info.kernel_helpers == changes["kernel_helpers"]
        assert engine.prefill_process is None
        assert engine.stats().prefill == "off"
        assert [e["reason"] for e in logs if e["event"] == "prefill_process_off"] == [reason]
    finally:
        await engine.close()
