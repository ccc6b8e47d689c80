"""Reading and writing the two wire formats, the prompt files, and the soak's memory sources — offline."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ttft_sse.__main__ import main
from ttft_sse.bench import prompts, protocol
from ttft_sse.bench.client import Target
from ttft_sse.bench.load import Plan
from ttft_sse.bench.protocol import Lengths, SSEEvent, SSEReader, Step, read_event, read_whole
from ttft_sse.bench.soak import metric_value, process_rss_bytes


def test_sse_reader_splits_events_on_blank_lines_and_skips_comments_and_empty_events() -> None:
    lines = [": ping", "", "event: token", "id: 0", 'data: {"text":"Hi"}', "", "data: a", "data: b", "", "event: x", ""]
    assert list(SSEReader().feed_all(iter(lines))) == [
        SSEEvent("token", '{"text":"Hi"}'),
        SSEEvent("message", "a\nb"),
    ]


def test_native_events() -> None:
    assert read_event("native", SSEEvent("token", '{"text":" Paris"}')) == Step(text=" Paris")
    done = '{"finish_reason":"length","usage":{"prompt_tokens":9,"completion_tokens":8},"timings":{}}'
    assert read_event("native", SSEEvent("done", done)) == Step(finished=True, end=True, completion_tokens=8)
    error = '{"error":{"message":"generation failed","type":"server_error","param":null,"code":null}}'
    assert read_event("native", SSEEvent("error", error)) == Step(end=True, error="generation failed")
    assert read_event("native", SSEEvent("queued", '{"position":3}')) == Step()


def test_openai_chunks() -> None:
    def chunk(**fields: object) -> SSEEvent:
        return SSEEvent("message", json.dumps(fields))

    role = chunk(choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
    assert read_event("openai", role) == Step()  # the empty role chunk is not a first token
    text = chunk(choices=[{"index": 0, "delta": {"content": "Par"}, "finish_reason": None}])
    assert read_event("openai", text) == Step(text="Par")
    final = chunk(choices=[{"index": 0, "delta": {}, "finish_reason": "stop"}])
    assert read_event("openai", final) == Step(finished=True)
    usage = chunk(choices=[], usage={"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12})
    assert read_event("openai", usage) == Step(completion_tokens=7)
    failure = chunk(error={"message": "internal server error", "type": "server_error"})
    assert read_event("openai", failure) == Step(error="internal server error")
    assert read_event("openai", SSEEvent("message", "[DONE]")) == Step(end=True)


def test_request_bodies_are_greedy_and_ask_openai_servers_for_usage() -> None:
    messages = [{"role": "user", "content": "Hi"}]
    assert protocol.request("native", "stream", messages, 8, "") == (
        "/stream",
        {"messages": messages, "max_tokens": 8, "temperature": 0},
    )
    assert protocol.request("native", "batch", messages, 8, "")[0] == "/complete"
    path, body = protocol.request("openai", "stream", messages, 8, "m")
    assert (path, body["stream"], body["stream_options"], body["model"]) == (
        "/v1/chat/completions",
        True,
        {"include_usage": True},
        "m",
    )
    assert protocol.request("openai", "batch", messages, 8, "m")[1]["stream"] is False
    assert body["temperature"] == 0


def test_request_bodies_carry_the_temperature_asked_for() -> None:
    messages = [{"role": "user", "content": "Hi"}]
    for proto in ("native", "openai"):
        for mode in ("stream", "batch"):
            assert protocol.request(proto, mode, messages, 8, "m", 1.0)[1]["temperature"] == 1.0


def test_request_bodies_carry_ignore_eos_only_when_asked() -> None:
    messages = [{"role": "user", "content": "Hi"}]
    for proto in ("native", "openai"):
        for mode in ("stream", "batch"):
            assert "ignore_eos" not in protocol.request(proto, mode, messages, 8, "m")[1]
            assert protocol.request(proto, mode, messages, 8, "m", ignore_eos=True)[1]["ignore_eos"] is True


def test_whole_replies() -> None:
    assert read_whole("native", {"text": "Paris.", "usage": {"completion_tokens": 3}}) == ("Paris.", 3)
    reply = {"choices": [{"message": {"role": "assistant", "content": "Paris."}}], "usage": {"completion_tokens": 3}}
    assert read_whole("openai", reply) == ("Paris.", 3)
    with pytest.raises(ValueError, match="no text"):
        read_whole("openai", {"choices": []})


def test_the_default_prompt_set_has_short_long_and_multilingual_chat_prompts() -> None:
    shipped = prompts.default_prompts()
    kinds = {p.kind for p in shipped}
    langs = {p.lang for p in shipped}
    assert kinds == {"short", "long"}
    assert {"en", "fr", "de", "es", "zh", "ja"} <= langs
    assert len({p.name for p in shipped}) == len(shipped)
    assert all(p.messages[-1]["role"] == "user" for p in shipped)
    size = {p.name: sum(len(m["content"]) for m in p.messages) for p in shipped}
    shortest_long = min(size[p.name] for p in shipped if p.kind == "long")
    assert shortest_long > 3 * max(size[p.name] for p in shipped if p.kind == "short")


def test_a_range_of_max_tokens_is_spread_evenly_over_the_requests_and_the_same_for_every_arm() -> None:
    assert {Lengths(64, 64).at(i) for i in range(100)} == {64}
    spread = Lengths(32, 96)
    asked = [spread.at(i) for i in range(650)]
    counts = [asked.count(n) for n in range(32, 97)]
    assert sum(counts) == 650 and min(counts) >= 9 and max(counts) <= 12  # every value, about 650 / 65 times each
    assert len(set(asked[:8])) == 8  # eight requests in flight at once ask for eight different lengths
    assert asked == [spread.at(i) for i in range(650)]  # request i asks for the same wherever it goes
    for low, high in ((0, 4), (5, 4)):
        with pytest.raises(ValueError, match="1 or more, low to high"):
            Lengths(low, high)


def test_a_tagged_prompt_is_a_new_conversation_behind_the_same_system_prompt_and_earlier_turns() -> None:
    turns = (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Name a colour."},
    )
    prompt = prompts.Prompt("chat", turns, kind="chat", lang="en")
    tagged = prompt.tagged("ab12-8-3")
    assert tagged.messages == (*turns[:3], {"role": "user", "content": "Request ab12-8-3: Name a colour."})
    assert (tagged.name, tagged.kind, tagged.lang) == ("chat", "chat", "en")
    assert prompt.messages == turns  # the prompt set itself is unchanged
    system_only = prompts.Prompt("s", ({"role": "system", "content": "Say hi."},))
    assert system_only.tagged("x").messages == ({"role": "system", "content": "Request x: Say hi."},)


def test_a_plan_sends_each_request_as_a_new_conversation_unless_told_to_repeat_prompts() -> None:
    one = prompts.Prompt("p", ({"role": "user", "content": "Q"},))
    a, b = Target("http://a:1", "native", "a"), Target("http://b:1", "native", "b")
    a_openai = Target("http://a:1", "openai", "a openai")
    plan = Plan((a, b, a_openai), ("stream", "batch"), (1, 8), (one,), Lengths(8, 8), requests=4, prompt_tag="r1")
    sent = {
        (t.label, m, c, i): plan.prompt(t, m, c, i).messages[0]["content"]
        for t in plan.targets
        for m in plan.modes
        for c in plan.concurrency
        for i in range(4)
    }
    assert sent[("a", "stream", 8, 3)] == "Request r1-8-3: Q"
    assert sent[("a", "batch", 8, 3)] == "Request r1-8-3-1: Q"  # a second arm on the same server
    assert sent[("a openai", "batch", 8, 3)] == "Request r1-8-3-3: Q"
    assert sent[("b", "stream", 8, 3)] == sent[("a", "stream", 8, 3)]  # two servers compared get the same prompts
    on_a = [text for (label, *_), text in sent.items() if label != "b"]
    assert len(set(on_a)) == len(on_a) == 2 * 2 * 2 * 4  # no request repeats one server A has seen
    plain = Plan((a,), ("stream",), (1, 8), (one,), Lengths(8, 8), requests=4)
    assert all(plain.prompt(a, "stream", c, i) is one for c in (1, 8) for i in range(4))


def test_prompt_files_in_json_lines_or_text(tmp_path: Path) -> None:
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"name": "a", "prompt": "Hello"}\n\n{"messages": [{"role": "user", "content": "Hi"}]}\n')
    first, second = prompts.load(jsonl)
    assert (first.name, first.as_messages()) == ("a", [{"role": "user", "content": "Hello"}])
    assert (second.name, second.kind) == ("line-3", "custom")
    text = tmp_path / "p.txt"
    text.write_text("What is 2+2?\n  \nName a colour.\n")
    assert [p.as_messages()[0]["content"] for p in prompts.load(text)] == ["What is 2+2?", "Name a colour."]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "holds no prompt"),
        ('{"prompt": "a"}\nnot json\n', "p.jsonl, line 2: not valid JSON"),
        ('{"prompt": "a", "messages": []}\n', "line 1: give either messages or prompt"),
        ('{"messages": [{"role": "robot", "content": "x"}]}\n', "messages[0] must be"),
    ],
)
def test_bad_prompt_files_are_refused_naming_the_line(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(prompts.PromptFileError, match=message.replace("[", r"\[").replace("]", r"\]")):
        prompts.load(path)


def test_rss_from_a_prometheus_exposition_and_from_proc() -> None:
    exposition = (
        "# HELP process_resident_memory_bytes Resident memory size in bytes.\n"
        "# TYPE process_resident_memory_bytes gauge\n"
        "process_resident_memory_bytes 6.0817408e+08\n"
        "process_virtual_memory_bytes 2.1e+09\n"
    )
    assert metric_value(exposition, "process_resident_memory_bytes") == 608174080.0
    assert metric_value('x_total{path="/a"} 3\n', "x_total") == 3.0
    assert metric_value("other 1\n", "process_resident_memory_bytes") is None
    mine = process_rss_bytes(os.getpid())
    assert mine is not None and mine > 10 * 2**20  # this interpreter, with pytest and numpy loaded
    assert process_rss_bytes(2**22 + 12345) is None  # above the kernel's PID limit: no such process


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--url", "http://a:1", "--url", "http://b:2"] + ["--protocol", "native"] * 3,
            "give --protocol once, or once per --url (2)",
        ),
        (["--url", "http://a:1", "--concurrency", "1,x"], "--concurrency takes whole numbers"),
        (["--url", "http://a:1", "--mode", "stream,fast"], "--mode takes stream, batch or stream,batch"),
        (["--url", "127.0.0.1:8000"], "--url must be like http://127.0.0.1:8000"),
        (["--url", "http://a:1", "--max-tokens", "0"], "--max-tokens takes N or LOW-HIGH of 1 or more"),
        (["--url", "http://a:1", "--max-tokens", "96-32"], "like 64 or 32-96; got '96-32'"),
        (["--url", "http://a:1", "--max-tokens", "32-"], "like 64 or 32-96; got '32-'"),
        (["--url", "http://a:1", "--max-tokens", "many"], "like 64 or 32-96; got 'many'"),
        (["--url", "http://a:1", "--temperature", "3"], "--temperature must be between 0 and 2"),
    ],
)
def test_bad_bench_arguments_exit_2_saying_what_to_give(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", *args]) == 2
    assert message in capsys.readouterr().err
