"""Request value types and their validation. Every refusal is an ``InvalidRequest`` that names the field.

The limits below are written once and read twice: by the validators, and by :meth:`GenerationRequest.json_schema`,
the JSON Schema that ``GET /openapi.json`` publishes (a test checks the two accept the same bodies).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from starlette.datastructures import QueryParams

from ttft_sse import json_input
from ttft_sse.engine.base import ROLES, ChatMessage, Role, SamplingParams
from ttft_sse.errors import InvalidRequest, PromptTooLong, listed, quoted

MAX_STOP_SEQUENCES = 4
FIELDS = (
    "prompt",
    "messages",
    "raw",
    "parse_special",
    "max_tokens",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "cache_salt",
)
MAX_CACHE_SALT = 256  # cache_salt: 1 to this many characters
MAX_TEMPERATURE = 2.0  # temperature: 0 to this, both included
# top_p: more than 0, at most 1
SEED_LIMIT = 2**63  # seed: 0 up to this, not included (torch's generator takes a signed 64-bit seed)
MESSAGE_FIELDS = ("role", "content", "name", "tool_call_id")  # name is accepted and not used


@dataclass(frozen=True)
class GenerationRequest:
    prompt: str | None
    messages: tuple[ChatMessage, ...] | None
    raw: bool = False
    # With raw: special-token strings in the prompt are the model's special tokens (True) or text (False). Messages
    # and templated prompts are always text (engine/prompts.py).
    parse_special: bool = True
    max_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    cache_salt: str | None = None  # keeps the request's prefix-cache blocks apart (ttft_sse/admission/isolation.py)

    @classmethod
    def from_json(cls, body: Any, *, max_tokens_cap: int) -> GenerationRequest:
        if not isinstance(body, dict):
            raise InvalidRequest(f"the request body must be a JSON object, not {json_type(body)}")
        unknown = sorted(set(body) - set(FIELDS))
        if unknown:
            raise InvalidRequest(
                f"unknown field(s): {listed(unknown)}; accepted: {', '.join(FIELDS)}", param=unknown[0]
            )
        return cls._build(body, max_tokens_cap)

    @classmethod
    def from_query(cls, query: QueryParams, *, max_tokens_cap: int) -> GenerationRequest:
        """GET form, for ``EventSource``: scalars as text, ``stop`` repeated, ``messages`` as a JSON string."""
        unknown = sorted(set(query.keys()) - set(FIELDS))
        if unknown:
            raise InvalidRequest(
                f"unknown query parameter(s): {listed(unknown)}; accepted: {', '.join(FIELDS)}", param=unknown[0]
            )
        values: dict[str, Any] = {}
        for key in query:
            if key == "stop":
                stops = query.getlist("stop")
                values["stop"] = stops[0] if len(stops) == 1 else stops
                continue
            if len(query.getlist(key)) > 1:
                raise InvalidRequest(f"{key} is given more than once", param=key)
            text = query[key]
            if key == "messages":
                try:
                    values[key] = json_input.parse(text, name=key)
                except InvalidRequest as exc:
                    if exc.code != "invalid_json":
                        raise  # too deep, a number out of range, invalid Unicode: said as such
                    raise InvalidRequest("messages must be a JSON array of {role, content}", param=key) from None
            elif key in ("max_tokens", "seed"):
                values[key] = _parse_number(key, text, int)
            elif key in ("temperature", "top_p"):
                values[key] = _parse_number(key, text, float)
            elif key in ("raw", "parse_special"):
                values[key] = _parse_bool(key, text)
            else:
                values[key] = text
        return cls._build(values, max_tokens_cap)

    @classmethod
    def _build(cls, body: Mapping[str, Any], cap: int) -> GenerationRequest:
        prompt = body.get("prompt")
        messages = body.get("messages")
        if prompt is not None and messages is not None:
            raise InvalidRequest("give either prompt or messages, not both", param="messages")
        if prompt is None and messages is None:
            raise InvalidRequest("prompt or messages is required", param="prompt")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise InvalidRequest(f"prompt must be a string, not {json_type(prompt)}", param="prompt")
            if not prompt.strip():
                raise InvalidRequest("prompt is empty", param="prompt")
        parsed_messages = _messages(messages) if messages is not None else None
        raw = body.get("raw", False)
        if not isinstance(raw, bool):
            raise InvalidRequest(f"raw must be true or false, not {json_type(raw)}", param="raw")
        if raw and parsed_messages is not None:
            raise InvalidRequest(
                "raw applies to prompt only; messages always go through the chat template", param="raw"
            )
        parse_special = body.get("parse_special", True)
        if not isinstance(parse_special, bool):
            raise InvalidRequest(
                f"parse_special must be true or false, not {json_type(parse_special)}", param="parse_special"
            )
        if "parse_special" in body and parse_special and not raw:
            raise InvalidRequest(
                "parse_special applies to raw prompts only; messages and templated prompts are always read as text",
                param="parse_special",
            )
        max_tokens = body.get("max_tokens")
        if max_tokens is not None:
            max_tokens = _integer("max_tokens", max_tokens)
            if not 1 <= max_tokens <= cap:
                raise InvalidRequest(f"max_tokens must be between 1 and {cap}, got {max_tokens}", param="max_tokens")
        temperature = _number("temperature", body.get("temperature", 0.0))
        if not 0.0 <= temperature <= MAX_TEMPERATURE:
            raise InvalidRequest(
                f"temperature must be between 0 and {MAX_TEMPERATURE:g}, got {temperature:g}", param="temperature"
            )
        top_p = _number("top_p", body.get("top_p", 1.0))
        if not 0.0 < top_p <= 1.0:
            raise InvalidRequest(f"top_p must be more than 0 and at most 1, got {top_p:g}", param="top_p")
        seed = body.get("seed")
        if seed is not None:
            seed = _integer("seed", seed)
            if not 0 <= seed < SEED_LIMIT:
                raise InvalidRequest("seed must be between 0 and 2**63-1", param="seed")
        cache_salt = body.get("cache_salt")
        if cache_salt is not None and not (isinstance(cache_salt, str) and 1 <= len(cache_salt) <= MAX_CACHE_SALT):
            raise InvalidRequest(
                f"cache_salt must be a string of 1 to {MAX_CACHE_SALT} characters, got {quoted(cache_salt)}",
                param="cache_salt",
            )
        return cls(
            prompt=prompt,
            messages=parsed_messages,
            raw=raw,
            parse_special=parse_special,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            stop=_stops(body.get("stop")),
            seed=seed,
            cache_salt=cache_salt,
        )

    @staticmethod
    def json_schema(*, max_tokens_cap: int) -> dict[str, Any]:
        """The JSON Schema (2020-12) of the bodies :meth:`from_json` accepts, from the same limits.

        All of it but what only the model can judge (a prompt's length in tokens, against its context) and what the
        JSON reader refuses before any validator runs (lone surrogates, NaN). ``GET /openapi.json`` publishes it; a
        test draws bodies, good and bad, and checks that this schema and :meth:`from_json` agree on every one.
        """
        fields = field_schemas(max_tokens_cap=max_tokens_cap)
        return {
            "type": "object",
            "properties": fields,
            "additionalProperties": False,
            # prompt or messages, not both; null means "not given"
            "oneOf": [
                {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
            ],
            "allOf": [
                # raw applies to prompt only
                {
                    "if": {"required": ["raw"], "properties": {"raw": {"const": True}}},
                    "then": {"properties": {"messages": {"type": "null"}}},
                },
                # parse_special (true) applies to raw prompts only
                {
                    "if": {"required": ["parse_special"], "properties": {"parse_special": {"const": True}}},
                    "then": {"required": ["raw"], "properties": {"raw": {"const": True}}},
                },
            ],
        }

    def as_body(self) -> dict[str, Any]:
        """The JSON body that ``from_json`` reads back into an equal request (how a job travels to a worker)."""
        body: dict[str, Any] = {
            "raw": self.raw,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stop": list(self.stop),
        }
        if not self.parse_special:
            body["parse_special"] = False
        if self.prompt is not None:
            body["prompt"] = self.prompt
        if self.messages is not None:
            body["messages"] = [_message_body(m) for m in self.messages]
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        if self.seed is not None:
            body["seed"] = self.seed
        if self.cache_salt is not None:
            body["cache_salt"] = self.cache_salt
        return body

    def sampling(self, *, prompt_tokens: int, context_length: int, default_max_tokens: int) -> SamplingParams:
        """Sampling parameters for a prompt of ``prompt_tokens``; refuses a ``max_tokens`` that cannot fit."""
        room = context_length - prompt_tokens
        if self.max_tokens is None:
            max_tokens = min(default_max_tokens, room)
        elif self.max_tokens > room:
            raise PromptTooLong(
                f"the prompt is {prompt_tokens} tokens and max_tokens is {self.max_tokens}, but the model's context "
                f"is {context_length} tokens; lower max_tokens to {room} or shorten the prompt",
                param="max_tokens",
                code="context_length_exceeded",
            )
        else:
            max_tokens = self.max_tokens
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            stop=self.stop,
            cache_salt=self.cache_salt or "",
        )


def _message_body(message: ChatMessage) -> dict[str, str]:
    body = {"role": message.role, "content": message.content}
    if message.tool_call_id is not None:
        body["tool_call_id"] = message.tool_call_id
    return body


NOT_BLANK = r"\S"  # a pattern: some character other than whitespace (str.strip's whitespace)


def message_schema() -> dict[str, Any]:
    """One chat message, as :func:`_messages` takes it."""
    return {
        "type": "object",
        "properties": {
            "role": {"enum": list(ROLES)},
            "content": {"type": "string"},
            "name": {"description": "accepted and not used"},
            "tool_call_id": {"type": "string", "description": "a tool message's: the tool call it answers"},
        },
        "required": ["role", "content"],
        "additionalProperties": False,
        # tool_call_id belongs to tool messages
        "if": {"properties": {"role": {"const": "tool"}}},
        "else": {"not": {"required": ["tool_call_id"]}},
    }


def field_schemas(*, max_tokens_cap: int) -> dict[str, dict[str, Any]]:
    """Each field of a generation request: its JSON Schema, written from the limits the validators use."""
    stop = {"type": "string", "minLength": 1}
    return {
        "prompt": {
            "type": ["string", "null"],
            "pattern": NOT_BLANK,
            "description": "The text to continue (with raw) or the user's message (through the chat template).",
        },
        "messages": {
            "type": ["array", "null"],
            "items": message_schema(),
            "minItems": 1,
            "contains": {"type": "object", "required": ["content"], "properties": {"content": {"pattern": NOT_BLANK}}},
            "description": "A conversation, through the model's chat template; at least one message not empty.",
        },
        "raw": {"type": "boolean", "default": False, "description": "prompt as is, without the chat template"},
        "parse_special": {
            "type": "boolean",
            "default": True,
            "description": "with raw: special-token strings in the prompt are read as the model's special tokens "
            "(true) or as text (false); messages and templated prompts are always text",
        },
        "max_tokens": {
            "type": ["integer", "null"],
            "minimum": 1,
            "maximum": max_tokens_cap,
            "description": "at most this many tokens; also no more than the model's context leaves after the prompt",
        },
        "temperature": {"type": "number", "minimum": 0, "maximum": MAX_TEMPERATURE, "default": 0.0},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1, "default": 1.0},
        "stop": {
            "anyOf": [{"type": "null"}, stop, {"type": "array", "items": stop, "maxItems": MAX_STOP_SEQUENCES}],
            "description": "generation stops before the first of these; it is not part of the text",
        },
        "seed": {"type": ["integer", "null"], "minimum": 0, "maximum": SEED_LIMIT - 1},
        "cache_salt": {
            "type": ["string", "null"],
            "minLength": 1,
            "maxLength": MAX_CACHE_SALT,
            "description": "keeps this request's prefix-cache blocks apart from those of requests with another salt "
            "(or none): no timing tells another caller whether this prompt was sent",
        },
    }


def _messages(value: Any) -> tuple[ChatMessage, ...]:
    if not isinstance(value, list):
        raise InvalidRequest(f"messages must be a list, not {json_type(value)}", param="messages")
    if not value:
        raise InvalidRequest("messages is empty", param="messages")
    out = []
    for i, item in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest(f"{where} must be an object with role and content", param=where)
        role, content = item.get("role"), item.get("content")
        if not isinstance(role, str) or role not in ROLES:
            raise InvalidRequest(
                f"{where}.role must be one of {', '.join(ROLES)}, got {quoted(role)}", param=f"{where}.role"
            )
        if not isinstance(content, str):
            raise InvalidRequest(f"{where}.content must be a string", param=f"{where}.content")
        extra = sorted(set(item) - set(MESSAGE_FIELDS))
        if extra:
            raise InvalidRequest(f"{where} has unknown field(s): {listed(extra)}", param=f"{where}.{extra[0]}")
        tool_call_id = item.get("tool_call_id")
        if "tool_call_id" in item:
            if role != "tool":
                raise InvalidRequest(
                    f"{where}.tool_call_id belongs to a tool message, not a {role} one", param=f"{where}.tool_call_id"
                )
            if not isinstance(tool_call_id, str):
                raise InvalidRequest(
                    f"{where}.tool_call_id must be a string, not {json_type(tool_call_id)}",
                    param=f"{where}.tool_call_id",
                )
        out.append(ChatMessage(role=cast(Role, role), content=content, tool_call_id=tool_call_id))
    if not any(m.content.strip() for m in out):
        raise InvalidRequest("every message is empty", param="messages")
    return tuple(out)


def _stops(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise InvalidRequest("stop must be a string or a list of strings", param="stop")
    if len(items) > MAX_STOP_SEQUENCES:
        raise InvalidRequest(f"stop takes at most {MAX_STOP_SEQUENCES} sequences, got {len(items)}", param="stop")
    if any(not s for s in items):
        raise InvalidRequest("stop sequences must not be empty", param="stop")
    return tuple(items)


def _integer(name: str, value: Any) -> int:
    """An integer (an integral float such as ``5.0`` too, as JSON does not tell them apart); never inf or NaN."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(f"{name} must be an integer, not {json_type(value)}", param=name)
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise InvalidRequest(f"{name} must be an integer, not {value!r}", param=name)
    return int(value)


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(f"{name} must be a number, not {json_type(value)}", param=name)
    try:
        number = float(value)
    except OverflowError:  # an int past a double
        raise InvalidRequest(f"{name} must be a number within range", param=name) from None
    if not math.isfinite(number):
        raise InvalidRequest(f"{name} must be a finite number, not {number!r}", param=name)
    return number


def _parse_number(name: str, text: str, kind: type[int] | type[float]) -> int | float:
    noun = "an integer" if kind is int else "a number"
    if len(text) > json_input.MAX_INTEGER_DIGITS + 8:  # no value in range is written so long
        raise InvalidRequest(f"{name} must be {noun}, got {len(text)} characters", param=name)
    try:
        value = kind(text)
    except ValueError:
        raise InvalidRequest(f"{name} must be {noun}, got {text!r}", param=name) from None
    return value


def _parse_bool(name: str, text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes"):
        return True
    if lowered in ("0", "false", "no"):
        return False
    raise InvalidRequest(f"{name} must be true or false, got {text!r}", param=name)


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
