"""JSON from clients, read with limits: the one reader of request bodies (and of ``messages`` in a query string).

``json.loads`` alone turns hostile input into 500s: nesting a few thousand deep raises ``RecursionError``, an integer
of more than 4,300 digits ``ValueError`` (CPython's int-string limit), and ``"\\ud800"`` yields a ``str`` holding a lone
surrogate, which the tokenizer refuses with ``TypeError``. :func:`parse` answers each with an ``InvalidRequest``
that names where it is:

* the text must be UTF-8 (RFC 8259 §8.1) and valid JSON (code ``invalid_json``);
* nesting: at most :data:`MAX_DEPTH` arrays and objects inside each other, counted before ``json`` parses anything
  (code ``too_deep``), so its recursion never comes near Python's limit;
* numbers: an integer of more than :data:`MAX_INTEGER_DIGITS` digits, a number beyond a double (``1e999``), and the
  constants ``NaN``, ``Infinity``, ``-Infinity`` (not JSON, though ``json`` reads them) are refused where they stand,
  ``max_tokens`` or ``messages[2].content`` (code ``number_out_of_range``);
* text: a string, value or key, holding a lone surrogate is refused naming it (code ``invalid_unicode``).

Paths are written as the validators write them: ``messages[0].content``; the body itself is "the request body".
"""

from __future__ import annotations

import itertools
import json
import math
import re
from typing import Any

from ttft_sse.errors import InvalidRequest

MAX_DEPTH = 64
"""Arrays and objects inside each other. The API's deepest body (an OpenAI message's content parts) is 4 deep."""

MAX_INTEGER_DIGITS = 32
"""Digits of a JSON integer. Every integer field fits 19 (``seed`` < 2**63); 32 leaves room for a helpful range
message about a number that is merely too big."""

# A JSON string, or an unterminated one up to the end of the text, matched possessively: each quote is looked at
# once, so stripping strings is linear whatever the text (a backtracking pattern is quadratic on '"\"\"\"…').
_STRING = re.compile(r'"(?:[^"\\]++|\\.|\\\Z)*+(?:"|\Z)', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]++")
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}
# Lone surrogates reach a str only through \uD800-\uDFFF escapes (strict UTF-8 decoding refuses encoded ones).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")


class _Refused:
    """A number JSON can write but the API cannot take; it stands in the parsed value until its path is known."""

    __slots__ = ("text", "why")

    def __init__(self, text: str, why: str) -> None:
        self.text = text
        self.why = why


def parse(data: bytes | str, *, name: str | None = None) -> Any:
    """The JSON value of ``data``; ``name`` is what the value is called in errors (None: the request body)."""
    what = name or "the request body"
    if isinstance(data, bytes):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidRequest(
                f"{what} is not valid JSON: it is not UTF-8 (byte {exc.start})", param=name, code="invalid_json"
            ) from None
    else:
        text = data
    deepest = _depth(text)
    if deepest > MAX_DEPTH:
        raise InvalidRequest(
            f"{what} nests arrays and objects {deepest} deep; the limit is {MAX_DEPTH}", param=name, code="too_deep"
        )
    refused: list[_Refused] = []

    def integer(digits: str) -> int | _Refused:
        if len(digits.lstrip("-")) > MAX_INTEGER_DIGITS:
            refused.append(_Refused(digits, f"an integer of {len(digits.lstrip('-'))} digits"))
            return refused[-1]
        return int(digits)

    def real(digits: str) -> float | _Refused:
        value = float(digits)
        if not math.isfinite(value):
            refused.append(_Refused(digits, "beyond the range of a double"))
            return refused[-1]
        return value

    def constant(word: str) -> _Refused:
        refused.append(_Refused(word, "not a JSON number"))
        return refused[-1]

    try:
        value = json.loads(text, parse_int=integer, parse_float=real, parse_constant=constant)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"{what} is not valid JSON: {exc}", param=name, code="invalid_json") from None
    except RecursionError:  # not expected below MAX_DEPTH; a 400 all the same, never a 500
        raise InvalidRequest(f"{what} nests too deep", param=name, code="too_deep") from None
    if refused or _SURROGATE_ESCAPE.search(text):
        _check(value, name)
    return value


def _depth(text: str) -> int:
    """How deep arrays and objects nest in ``text`` (brackets inside strings do not count)."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return 0  # cannot nest deeper than the limit: the common case costs two counts
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return max(itertools.accumulate(map(_STEP.__getitem__, map(ord, brackets))), default=0)


def _check(root: Any, name: str | None) -> None:
    """Refuse the first refused number or invalid text in ``root``, naming its path."""
    stack: list[tuple[Any, str | None]] = [(root, name)]
    while stack:
        value, path = stack.pop()
        where = path or "the request body"
        if isinstance(value, _Refused):
            raise InvalidRequest(f"{where} is {_cut(value.text)}: {value.why}", param=path, code="number_out_of_range")
        if isinstance(value, str):
            _text(value, where, path)
        elif isinstance(value, list):
            stack.extend((item, f"{path or ''}[{i}]") for i, item in reversed(list(enumerate(value))))
        elif isinstance(value, dict):
            children = []
            for key, item in value.items():
                child = f"{path}.{key}" if path else key
                _text(key, f"a field name in {where}", child)
                children.append((item, child))
            stack.extend(reversed(children))


def _text(value: str, where: str, path: str | None) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        surrogate = f"U+{ord(value[exc.start]):04X}"
        raise InvalidRequest(
            f"{where} is not valid Unicode: it holds a lone surrogate ({surrogate}) at character {exc.start}",
            param=path,
            code="invalid_unicode",
        ) from None


def _cut(text: str, limit: int = 24) -> str:
    return text if len(text) <= limit else f"{text[:limit]}…"
