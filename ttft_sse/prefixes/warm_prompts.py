"""``TTFT_WARM_PROMPTS``: prompts whose KV the server computes before it is ready, and keeps.

The file is JSON Lines, one object a line with ``prompt`` (text, through the chat template unless ``raw``) or
``messages`` (a conversation's start: a product's system prompt, its few-shot examples); blank lines are skipped.
A request that starts with the same tokens finds them in the prefix cache from the first request on
(docs/settings.md, "Warm prompts"). A bad file stops the server at start, with the line that is wrong.
"""

from __future__ import annotations

import json
from pathlib import Path

from ttft_sse.errors import ServiceError
from ttft_sse.schemas import GenerationRequest
from ttft_sse.settings import SettingsError

FIELDS = ("prompt", "messages", "raw")
"""What a line may hold."""


def check(path: str) -> None:
    """Refuse a bad file with ``SettingsError`` (the server's start: exit status 2 and the sentence)."""
    try:
        read(path)
    except ValueError as exc:
        raise SettingsError(str(exc)) from None


def read(path: str) -> tuple[GenerationRequest, ...]:
    """The file's prompts, in order. Raises ``ValueError`` naming the file and line of the first thing wrong."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValueError(f"cannot read the warm prompt file {path!r} (TTFT_WARM_PROMPTS): {reason}") from None
    prompts: list[GenerationRequest] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"the warm prompt file {path!r} (TTFT_WARM_PROMPTS), line {number}"
        try:
            body = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where} is not JSON: {exc.msg} at column {exc.colno}") from None
        if not isinstance(body, dict):
            raise ValueError(f"{where} must be a JSON object with prompt or messages") from None
        unknown = sorted(set(body) - set(FIELDS))
        if unknown:
            raise ValueError(f"{where} has unknown field(s) {', '.join(unknown)}; a line holds {', '.join(FIELDS)}")
        try:
            prompts.append(GenerationRequest.from_json(body, max_tokens_cap=1))
        except ServiceError as exc:
            raise ValueError(f"{where}: {exc.message}") from None
    if not prompts:
        raise ValueError(f"the warm prompt file {path!r} (TTFT_WARM_PROMPTS) holds no prompts; leave it unset instead")
    return tuple(prompts)
