"""The prompts a benchmark sends: the default set shipped with the package, or the user's own file.

A prompt file is either JSON Lines — one object per line with ``messages`` (``[{role, content}]``) or ``prompt``
(text, sent as one user message), and optionally ``name``, ``kind`` and ``lang`` — or plain text, one prompt per
non-empty line. Every prompt is sent as chat messages, so that the native and the OpenAI protocols do the same work
(the server applies the model's chat template to both).

A benchmark sends each request a new prompt unless asked not to (:meth:`Prompt.tagged`): a server that keeps the KV
of prompts it has seen (prefix caching: ours, vLLM's, llama-server's slots) would otherwise answer the second and
later sends of a prompt from its cache, and the figures would be those of repeats, not of new conversations.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

DEFAULT_SET = "prompts.jsonl"
ROLES = ("system", "user", "assistant")


class PromptFileError(ValueError):
    """A prompt file cannot be read; the message names the file, the line and what is wrong."""


@dataclass(frozen=True)
class Prompt:
    name: str
    messages: tuple[dict[str, str], ...]
    kind: str = "custom"
    lang: str = ""

    def as_messages(self) -> list[dict[str, str]]:
        return [dict(m) for m in self.messages]

    def tagged(self, tag: str) -> Prompt:
        """This prompt as a new conversation: its last user message (the last message if none is the user's)
        begins with ``Request <tag>: ``. What comes before that message (a system prompt, earlier turns) is
        unchanged, so a server still shares it with other requests, as it would a real conversation's."""
        roles = [m["role"] for m in self.messages]
        at = len(roles) - 1 - roles[::-1].index("user") if "user" in roles else len(roles) - 1
        messages = list(self.messages)
        messages[at] = {**messages[at], "content": f"Request {tag}: {messages[at]['content']}"}
        return Prompt(self.name, tuple(messages), self.kind, self.lang)


def default_prompts() -> list[Prompt]:
    """The shipped set: short and long chat prompts, some in French, German, Spanish, Chinese and Japanese."""
    text = resources.files(__package__).joinpath(DEFAULT_SET).read_text(encoding="utf-8")
    return parse(text, source=f"the default set ({DEFAULT_SET})")


def load(path: Path | None) -> list[Prompt]:
    if path is None:
        return default_prompts()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PromptFileError(f"cannot read the prompt file {path}: {exc.strerror or exc}") from None
    return parse(text, source=str(path))


def parse(text: str, *, source: str) -> list[Prompt]:
    lines = [(n, line) for n, line in enumerate(text.splitlines(), start=1) if line.strip()]
    if not lines:
        raise PromptFileError(f"{source} holds no prompt")
    as_json = lines[0][1].lstrip().startswith("{")
    prompts = [_json_line(line, source, n) if as_json else _text_line(line, n) for n, line in lines]
    return prompts


def _text_line(line: str, n: int) -> Prompt:
    return Prompt(name=f"line-{n}", messages=({"role": "user", "content": line.strip()},))


def _json_line(line: str, source: str, n: int) -> Prompt:
    where = f"{source}, line {n}"
    try:
        item: Any = json.loads(line)
    except json.JSONDecodeError as exc:
        raise PromptFileError(
            f"{where}: not valid JSON ({exc.msg}); a JSON Lines file needs one object a line"
        ) from None
    if not isinstance(item, dict):
        raise PromptFileError(f"{where}: each line must be a JSON object with messages or prompt")
    messages, prompt = item.get("messages"), item.get("prompt")
    if (messages is None) == (prompt is None):
        raise PromptFileError(f"{where}: give either messages or prompt")
    if prompt is not None:
        if not isinstance(prompt, str) or not prompt.strip():
            raise PromptFileError(f"{where}: prompt must be a non-empty string")
        messages = [{"role": "user", "content": prompt}]
    if not isinstance(messages, list) or not messages:
        raise PromptFileError(f"{where}: messages must be a non-empty list of {{role, content}}")
    checked = []
    for i, message in enumerate(messages):
        if not (isinstance(message, dict) and message.get("role") in ROLES and isinstance(message.get("content"), str)):
            raise PromptFileError(f"{where}: messages[{i}] must be {{role: system|user|assistant, content: string}}")
        checked.append({"role": message["role"], "content": message["content"]})
    return Prompt(
        name=str(item.get("name") or f"line-{n}"),
        messages=tuple(checked),
        kind=str(item.get("kind") or "custom"),
        lang=str(item.get("lang") or ""),
    )
