"""The OpenAI request bodies (``/v1/chat/completions``, ``/v1/completions``): parsed onto a ``GenerationRequest``,
and described as JSON Schema (``GET /openapi.json``) from the same limits.

Deliberate choices, each as vLLM or llama-server make them:

* A feature this server does not have (n > 1, tools, logprobs, penalties, JSON mode…) is refused with a 400 naming the
  parameter, not ignored: a client that asks for it would otherwise get something else without knowing. The neutral
  value of each (``n: 1``, ``logprobs: false``, ``presence_penalty: 0``…) is accepted: clients send those by default.
* Fields this module does not know at all are ignored, and logged (``openai_fields_ignored``), as vLLM does. OpenAI
  adds request fields every few months and frameworks on top of the SDK pass them along; refusing would break them
  over fields that change nothing here. The vendor sampling knobs that do change output (``top_k``,
  ``repetition_penalty``…) are listed in ``_UNSUPPORTED`` and refused.
* ``model`` is not checked against the served model: one model is served and front ends often send a fixed name.
* Defaults are OpenAI's, not ``/stream``'s: an omitted ``temperature`` is 1 (``/stream`` is greedy by default).
* ``/v1/completions`` feeds the prompt to the model as is, without the chat template (``raw``), as vLLM does; its
  special-token strings are the model's special tokens, unless the body says ``"parse_special": false`` (this
  server's field, as on ``/stream``). Chat messages are always text (engine/prompts.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ttft_sse.engine.base import ROLES
from ttft_sse.errors import InvalidRequest, quoted
from ttft_sse.schemas import NOT_BLANK, GenerationRequest, field_schemas, json_type, message_schema

DEFAULT_TEMPERATURE = 1.0  # OpenAI's documented default, which vLLM also uses when a model sets none
OWNED_BY = "ttft-sse"
UNSUPPORTED_CODE = "unsupported_parameter"  # the code OpenAI gives to parameters a model does not take

_TOOLS = ": the model is served without tool calling"
_LOGPROBS = ": log probabilities are not returned"
_ONE = ": one choice is generated per request"

# Parameters this server does not implement: refused with a 400, unless the value is one of the neutral ones listed.
# Neutral values are compared strictly (True is not 1).
_UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "n": ((1,), _ONE),
    "best_of": ((1,), _ONE),
    "tools": (([],), _TOOLS),
    "tool_choice": (("none",), _TOOLS),
    "functions": (([],), _TOOLS),
    "function_call": (("none",), _TOOLS),
    "logprobs": ((False,), _LOGPROBS),
    "top_logprobs": ((0,), _LOGPROBS),
    "echo": ((False,), ": the reply does not repeat the prompt"),
    "suffix": (("",), ": there is no fill-in-the-middle"),
    "response_format": (({"type": "text"},), ': only {"type": "text"}; there is no JSON mode'),
    "frequency_penalty": ((0, 0.0), ""),
    "presence_penalty": ((0, 0.0), ""),
    "logit_bias": (({},), ""),
    "modalities": ((["text"],), ": text only"),
    "audio": ((), ": text only"),
    "prediction": ((), ""),
    "web_search_options": ((), ""),
    "reasoning_effort": ((), ": the model does not reason in a separate channel"),
    "verbosity": ((), ""),
    "moderation": ((), ""),
    # Sampling extensions of vLLM and llama-server that clients pass in ``extra_body``: they change the output.
    "top_k": ((0, -1), ""),
    "min_p": ((0, 0.0), ""),
    "typical_p": ((1, 1.0), ""),
    "repetition_penalty": ((1, 1.0), ""),
    "min_tokens": ((0,), ""),
    "ignore_eos": ((False,), ""),
    "use_beam_search": ((False,), ""),
    "guided_json": ((), ""),
    "guided_regex": ((), ""),
    "guided_choice": ((), ""),
    "guided_grammar": ((), ""),
    "grammar": ((), ""),
    "json_schema": ((), ""),
    "chat_template": ((), ": the model's own template is used"),
    "chat_template_kwargs": (({},), ": the model's own template is used"),
}
# Honoured; mapped onto GenerationRequest or onto the reply's framing.
_HONOURED = frozenset(
    {"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop"}
    | {"stream", "stream_options", "user", "parse_special", "cache_salt"}
)
# Known, and meaningless for a server that keeps nothing and has one tier: accepted without a word.
_INERT = frozenset(
    {"metadata", "store", "service_tier", "parallel_tool_calls", "safety_identifier"}
    | {"prompt_cache_key", "prompt_cache_retention", "prompt_cache_options"}
)
_STREAM_OPTIONS = frozenset({"include_usage", "include_obfuscation"})


@dataclass(frozen=True)
class OpenAIRequest:
    """An OpenAI request body, mapped: what to generate, and how to frame the reply."""

    generation: GenerationRequest
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    max_tokens_field: str = "max_tokens"  # the name the client used (max_completion_tokens is an alias)
    ignored: tuple[str, ...] = ()


def json_schema(*, chat: bool, max_tokens_cap: int) -> dict[str, Any]:
    """The JSON Schema (2020-12) of the bodies :func:`parse_chat` (``chat``) or :func:`parse_completion` accept,
    written from this module's tables and the shared field limits (``schemas.field_schemas``).

    What it cannot say is in the descriptions: ``max_tokens`` and ``max_completion_tokens``, when both are given,
    must agree; a prompt's length in tokens is the model's to judge. Fields it does not name are accepted and
    ignored (``additionalProperties``), as :func:`_parse` does.
    """
    ours = field_schemas(max_tokens_cap=max_tokens_cap)
    max_tokens = {**ours["max_tokens"], "description": "at most this many tokens; max_tokens and "
                  "max_completion_tokens are one setting: when both are given they must agree"}  # fmt: skip
    flag = {"type": ["boolean", "null"]}
    properties: dict[str, Any] = {
        "model": {"type": ["string", "null"], "description": "not checked: the reply names the model that answered"},
        "max_tokens": max_tokens,
        "max_completion_tokens": max_tokens,
        "temperature": {**ours["temperature"], "type": ["number", "null"], "default": DEFAULT_TEMPERATURE},
        "top_p": {**ours["top_p"], "type": ["number", "null"]},
        "stop": ours["stop"],
        "seed": ours["seed"],
        "cache_salt": ours["cache_salt"],
        "stream": flag,
        "stream_options": {
            "type": ["object", "null"],
            "properties": {key: flag for key in sorted(_STREAM_OPTIONS)},
            "additionalProperties": False,
        },
        "user": {"type": ["string", "null"], "description": "logged with the request, never echoed"},
    }
    if chat:
        properties["parse_special"] = {"enum": [None, False], "description": "messages are always read as text"}
    else:
        properties["parse_special"] = {**ours["parse_special"], "type": ["boolean", "null"]}
    for name in sorted(_INERT):
        properties[name] = {"description": "accepted; it changes nothing here"}
    for name, (neutral, why) in sorted(_UNSUPPORTED.items()):
        properties[name] = {"enum": [None, *neutral], "description": f"not supported{why}; only its neutral value"}
    text_part = {
        "type": "object",
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
        "required": ["type", "text"],
    }
    if chat:
        properties["prompt"] = {"type": "null", "description": "belongs to /v1/completions"}
        message = message_schema()
        message["properties"]["role"] = {"enum": [*ROLES, "developer"]}
        message["properties"]["content"] = {"anyOf": [{"type": "string"}, {"type": "array", "items": text_part}]}
        message["additionalProperties"] = {"enum": [None, []], "description": "a reply's empty fields, dropped"}
        not_empty = {"anyOf": [{"type": "string", "pattern": NOT_BLANK}, {"type": "array", "contains": {
            "type": "object", "properties": {"text": {"pattern": NOT_BLANK}}}}]}  # fmt: skip
        properties["messages"] = {
            "type": "array",
            "items": message,
            "minItems": 1,
            "contains": {"type": "object", "required": ["content"], "properties": {"content": not_empty}},
        }
        required = ["messages"]
    else:
        properties["messages"] = {"type": "null", "description": "belongs to /v1/chat/completions"}
        one = {"type": "string", "pattern": NOT_BLANK}
        properties["prompt"] = {
            "anyOf": [one, {"type": "array", "items": one, "minItems": 1, "maxItems": 1}],
            "description": "one prompt, fed to the model as is (no chat template); token ids are not supported",
        }
        required = ["prompt"]
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": {"description": "not known here: ignored, and logged (openai_fields_ignored)"},
        # stream_options only with stream: true
        "if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
        "then": {"required": ["stream"], "properties": {"stream": {"const": True}}},
    }


def parse_chat(body: Any, *, max_tokens_cap: int) -> OpenAIRequest:
    """``/v1/chat/completions``: ``messages`` through the model's chat template."""
    return _parse(body, chat=True, max_tokens_cap=max_tokens_cap)


def parse_completion(body: Any, *, max_tokens_cap: int) -> OpenAIRequest:
    """``/v1/completions``: ``prompt`` as is (one prompt, as text)."""
    return _parse(body, chat=False, max_tokens_cap=max_tokens_cap)


def _parse(body: Any, *, chat: bool, max_tokens_cap: int) -> OpenAIRequest:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    for name, value in body.items():
        if name in _UNSUPPORTED:
            neutral, why = _UNSUPPORTED[name]
            if value is not None and not any(_same(value, n) for n in neutral):
                kinds = {json_type(n) for n in neutral}
                if kinds and json_type(value) not in kinds:  # the wrong type: say so, whatever the value meant
                    raise InvalidRequest(f"{name} must be {' or '.join(sorted(kinds))}, not {json_type(value)}",
                                         param=name)  # fmt: skip
                raise InvalidRequest(f"{name} is not supported by this server{why}", param=name, code=UNSUPPORTED_CODE)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest("model must be a string", param="model")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise InvalidRequest("stream must be true or false", param="stream")
    include_usage = _include_usage(body.get("stream_options"), stream=bool(stream))
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidRequest("user must be a string", param="user")
    max_tokens, max_tokens_field = _max_tokens(body)
    # null means "not given" for every optional OpenAI field.
    ours: dict[str, Any] = {
        key: value
        for key, value in (
            ("max_tokens", max_tokens),
            ("temperature", body.get("temperature")),
            ("top_p", body.get("top_p")),
            ("stop", body.get("stop")),
            ("seed", body.get("seed")),
            ("parse_special", body.get("parse_special")),
            ("cache_salt", body.get("cache_salt")),
        )
        if value is not None
    }
    ours.setdefault("temperature", DEFAULT_TEMPERATURE)
    wrong, right = ("prompt", "messages") if chat else ("messages", "prompt")
    if body.get(wrong) is not None:
        other = "/v1/completions" if chat else "/v1/chat/completions"
        raise InvalidRequest(f"{wrong} belongs to {other}; this endpoint takes {right}", param=wrong)
    if chat:
        if body.get("messages") is None:
            raise InvalidRequest("messages is required", param="messages")
        ours["messages"] = _messages(body["messages"])
    else:
        if body.get("prompt") is None:
            raise InvalidRequest("prompt is required", param="prompt")
        ours["prompt"] = _prompt(body["prompt"])
        ours["raw"] = True
    with renamed_max_tokens(max_tokens_field):
        generation = GenerationRequest.from_json(ours, max_tokens_cap=max_tokens_cap)
    known = _HONOURED | _INERT | _UNSUPPORTED.keys()
    return OpenAIRequest(
        generation=generation,
        stream=bool(stream),
        include_usage=include_usage,
        user=user,
        max_tokens_field=max_tokens_field,
        ignored=tuple(sorted(set(body) - known)),
    )


def _same(value: Any, neutral: Any) -> bool:
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    return bool(value == neutral)


def _include_usage(options: Any, *, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise InvalidRequest("stream_options is only allowed when stream is true", param="stream_options")
    if not isinstance(options, dict):
        raise InvalidRequest("stream_options must be an object", param="stream_options")
    for key in options:
        if key not in _STREAM_OPTIONS:
            where = f"stream_options.{key}"
            raise InvalidRequest(f"{where} is not supported by this server", param=where, code=UNSUPPORTED_CODE)
    # include_obfuscation is accepted and has no effect: no padding is added to chunks.
    for key in _STREAM_OPTIONS:
        if options.get(key) is not None and not isinstance(options[key], bool):
            raise InvalidRequest(f"stream_options.{key} must be true or false", param=f"stream_options.{key}")
    return bool(options.get("include_usage"))


def _max_tokens(body: dict[str, Any]) -> tuple[Any, str]:
    legacy, current = body.get("max_tokens"), body.get("max_completion_tokens")
    if current is None:
        return legacy, "max_tokens"
    if legacy is not None and legacy != current:
        raise InvalidRequest(
            f"max_tokens ({legacy}) and max_completion_tokens ({current}) disagree; give one of them",
            param="max_completion_tokens",
        )
    return current, "max_completion_tokens"


@contextmanager
def renamed_max_tokens(field: str) -> Iterator[None]:
    """Errors about ``max_tokens`` name ``field`` instead: the name the client used."""
    try:
        yield
    except InvalidRequest as exc:
        if field == "max_tokens" or exc.param != "max_tokens":
            raise
        raise type(exc)(exc.message.replace("max_tokens", field), param=field, code=exc.code) from None


def _messages(value: Any) -> Any:
    """OpenAI's message forms onto ours: text content parts joined, ``developer`` as ``system``, nulls dropped.

    Anything else is left as it is for ``GenerationRequest`` to judge, so the messages about it are the same as on
    ``/stream``.
    """
    if not isinstance(value, list):
        return value
    out: list[Any] = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            out.append(message)
            continue
        where = f"messages[{i}]"
        # A client that sends back an earlier reply's message includes its empty fields (refusal, tool_calls…).
        message = {k: v for k, v in message.items() if k in ("role", "content") or v not in (None, [])}
        for name in ("tool_calls", "function_call"):
            if name in message:
                raise InvalidRequest(
                    f"{where}.{name}: tool calls are not supported by this server",
                    param=f"{where}.{name}",
                    code=UNSUPPORTED_CODE,
                )
        if message.get("role") == "developer":  # OpenAI's newer name for the system role
            message["role"] = "system"
        if isinstance(message.get("content"), list):
            message["content"] = _text_parts(message["content"], f"{where}.content")
        out.append(message)
    return out


def _text_parts(parts: list[Any], where: str) -> str:
    texts = []
    for j, part in enumerate(parts):
        if not (isinstance(part, dict) and part.get("type") == "text"):
            kind = part.get("type") if isinstance(part, dict) else None
            raise InvalidRequest(
                f"{where}[{j}]: only text content parts are supported, got type {quoted(kind)}",
                param=f"{where}[{j}]",
            )
        if not isinstance(part.get("text"), str):
            said = "has no text field" if "text" not in part else f"has text {json_type(part['text'])}"
            raise InvalidRequest(
                f'{where}[{j}] is a text part and {said}: a text part is {{"type": "text", "text": <string>}}',
                param=f"{where}[{j}].text",
            )
        texts.append(part["text"])
    return "\n".join(texts)  # as vLLM joins them


def _prompt(value: Any) -> Any:
    if not isinstance(value, list):
        return value
    if not value:
        raise InvalidRequest("prompt is empty", param="prompt")
    if all(isinstance(p, str) for p in value):
        if len(value) > 1:
            raise InvalidRequest(
                f"prompt is a list of {len(value)} prompts; this server completes one prompt per request",
                param="prompt",
                code=UNSUPPORTED_CODE,
            )
        return value[0]
    if all((isinstance(p, int) and not isinstance(p, bool)) or isinstance(p, list) for p in value):
        raise InvalidRequest(
            "prompt as token ids is not supported by this server; send the text", param="prompt", code=UNSUPPORTED_CODE
        )
    return value


# -- routes ------------------------------------------------------------------------------------------------------
