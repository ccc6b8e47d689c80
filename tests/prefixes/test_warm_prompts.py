"""The warm prompt file (``TTFT_WARM_PROMPTS``): read in order, and a bad one refused at start naming its line."""

from __future__ import annotations

from pathlib import Path

import pytest

from ttft_sse.engine.base import ChatMessage
from ttft_sse.prefixes import warm_prompts
from ttft_sse.settings import Settings, SettingsError


def test_the_file_gives_its_prompts_in_order_skipping_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "warm.jsonl"
    path.write_text(
        '{"messages": [{"role": "system", "content": "You are terse."}]}\n\n{"prompt": "Hello", "raw": true}\n'
    )
    first, second = warm_prompts.read(str(path))
    assert first.messages == (ChatMessage(role="system", content="You are terse."),) and first.prompt is None
    assert (second.prompt, second.raw, second.messages) == ("Hello", True, None)
    assert Settings(warm_prompts=str(path)).warm_prompts == str(path)


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ('{"prompt": "ok"}\n{"prompt": "no end"\n', "line 2 is not JSON: Expecting ',' delimiter at column 20"),
        ('{"prompt": "ok"}\n\n["a"]\n', "line 3 must be a JSON object with prompt or messages"),
        ('{"prompt": "a", "max_tokens": 3}\n', "line 1 has unknown field(s) max_tokens; a line holds prompt, messages"),
        ('{"prompt": "a", "messages": []}\n', "line 1: give either prompt or messages, not both"),
        ('{"messages": [{"role": "wizard", "content": "x"}]}\n', "line 1: "),
        ("\n\n", "holds no prompts; leave it unset instead"),
    ],
)
def test_a_bad_file_is_refused_at_start_with_the_line_that_is_wrong(tmp_path: Path, text: str, said: str) -> None:
    path = tmp_path / "warm.jsonl"
    path.write_text(text)
    with pytest.raises(SettingsError) as caught:
        warm_prompts.check(str(path))
    assert said in str(caught.value)
    assert str(caught.value).startswith(f"the warm prompt file {str(path)!r} (TTFT_WARM_PROMPTS)")


def test_a_missing_file_is_refused_with_the_reason(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"cannot read the warm prompt file .*: No such file or directory"):
        warm_prompts.check(str(tmp_path / "absent.jsonl"))


def test_serve_refuses_a_bad_file_before_it_starts_with_exit_status_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ttft_sse.__main__ import main

    path = tmp_path / "warm.jsonl"
    path.write_text('{"prompt": "ok"}\n["a"]\n')
    monkeypatch.setenv("TTFT_WARM_PROMPTS", str(path))
    assert main(["serve", "--port", "1"]) == 2
    said = capsys.readouterr().err
    assert said.startswith(f"ttft-sse: the warm prompt file {str(path)!r} (TTFT_WARM_PROMPTS), line 2 must be")
