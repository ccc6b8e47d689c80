"""The access log: probes log at debug; generations and refusals keep their info lines."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import structlog
from starlette.testclient import TestClient
from structlog.testing import capture_logs

from ttft_sse.app import create_app
from ttft_sse.engine.fake import FakeEngine
from ttft_sse.settings import Settings


@contextmanager
def every_level() -> Iterator[list[dict[str, Any]]]:
    """Capture structlog's events at every level, debug included, whatever the process configured before."""
    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    try:
        with capture_logs() as logs:
            yield logs
    finally:
        structlog.configure(**saved)


def info_or_above(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if e["log_level"] not in ("debug", "notset")]


def test_a_probe_leaves_no_info_line_but_generations_and_refusals_keep_theirs() -> None:
    app = create_app(Settings(warmup=False, log_format="console"), FakeEngine())
    with every_level() as logs, TestClient(app) as client:
        while client.get("/readyz").status_code != 200:  # the model loads in the background
            time.sleep(0.01)
        start = len(logs)  # after the start-up's own lines ("ready" is logged as /readyz turns 200)
        probes = {path: client.get(path).status_code for path in ("/healthz", "/readyz", "/metrics")}
        probed = logs[start:]
        assert probes == {"/healthz": 200, "/readyz": 200, "/metrics": 200}
        assert info_or_above(probed) == []
        assert [(e["event"], e["path"], e["log_level"]) for e in probed] == [
            ("request", path, "debug") for path in probes
        ]

        start = len(logs)
        assert client.post("/complete", json={"prompt": "Hi"}).status_code == 200
        assert client.post("/complete", json={"prompt": ""}).status_code == 400
        lines = [(e["event"], e.get("status"), e.get("outcome")) for e in info_or_above(logs[start:])]
    assert lines == [("generation", None, "ok"), ("request", 200, None), ("request", 400, None)]


def test_each_line_is_written_in_one_write_so_that_threads_lines_never_interleave(monkeypatch: Any) -> None:
    """print would write the message, then its newline: another logger's whole line (transformers' own, from its
    thread) could land between them, and the stream would hold a line that is not one JSON object."""
    import io
    import json
    import sys

    from ttft_sse.log import configure

    class Recorder(io.StringIO):
        def __init__(self) -> None:
            super().__init__()
            self.writes: list[str] = []

        def write(self, text: str) -> int:
            self.writes.append(text)
            return super().write(text)

    stream, kept, handlers = Recorder(), structlog.get_config(), logging.getLogger().handlers[:]
    monkeypatch.setattr(sys, "stderr", stream)
    configure()
    try:
        structlog.get_logger("ttft_sse.test").info("one_line", n=1)
        (written,) = stream.writes
        assert written.endswith("\n") and json.loads(written)["event"] == "one_line"
    finally:
        structlog.configure(**kept)
        logging.getLogger().handlers[:] = handlers


def test_a_path_is_logged_cut_short_and_with_a_streams_id_as_its_digest() -> None:
    from ttft_sse.admission.grants import digest
    from ttft_sse.log import MAX_LOGGED_PATH, logged_path

    assert logged_path("/streams/abcDEF123_-x") == f"/streams/{digest('abcDEF123_-x')}"
    assert logged_path("/api/streams/abc/whatever") == f"/api/streams/{digest('abc')}/whatever"
    long = logged_path("/" + "a" * 10_000)
    assert len(long) == MAX_LOGGED_PATH and long.endswith("…")
    assert logged_path("/x\udc80") == "/x\\udc80"  # printable, whatever the path held
    assert logged_path("/healthz") == "/healthz"


def test_the_access_line_of_a_huge_path_is_bounded() -> None:
    app = create_app(Settings(warmup=False, log_format="console"), FakeEngine())
    with capture_logs() as logs, TestClient(app) as client:
        assert client.get("/" + "p" * 8000).status_code == 404
    (line,) = [e for e in logs if e["event"] == "request"]
    assert len(line["path"]) == 200
