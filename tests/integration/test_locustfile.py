"""deploy/locustfile.py, run by Locust itself (headless, in its own process) against a real server.

Each user sends a fixed number of streams; what is asserted is what Locust counted, never how fast anything was.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.servers import running
from ttft_sse.app import create_app
from ttft_sse.engine.fake import FakeEngine
from ttft_sse.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
LOCUSTFILE = ROOT / "deploy" / "locustfile.py"


USERS, EACH = 2, 5


def _locust(base: str, tmp_path: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """Locust's own statistics (``--json``) after USERS users have sent EACH streams (``--requests-per-user``)."""
    if importlib.util.find_spec("locust") is None:  # never import it here: it monkey-patches the whole process
        pytest.skip("locust is not installed (it is in the dev extra)")
    # -t is only a bound: the locustfile ends the run once every user has sent its requests.
    args = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--host", base, "--headless", "--only-summary"]
    args += ["-u", str(USERS), "-r", str(USERS), "-t", "90s", "--requests-per-user", str(EACH), "--max-tokens", "8"]
    args += ["--json"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=150, cwd=tmp_path)
    assert done.stdout.lstrip().startswith("["), done.stdout + done.stderr
    return {(row["method"], row["name"]): row for row in json.loads(done.stdout)}


def test_locust_reports_ttft_and_total_time_for_every_stream(tmp_path: Path) -> None:
    engine = FakeEngine(["Hello", ",", " world", "!"], delay=0.01, context_length=1000)
    with running(create_app(Settings(warmup=False), engine)) as base:
        rows = _locust(base, tmp_path)
    post, ttft, total = rows[("POST", "/stream")], rows[("SSE", "TTFT")], rows[("SSE", "total")]
    assert [r["num_requests"] for r in (post, ttft, total)] == [USERS * EACH] * 3
    assert [r["num_failures"] for r in (post, ttft, total)] == [0, 0, 0]
    assert total["total_content_length"] == USERS * EACH * 4  # the total row's "size" is the stream's tokens
    assert ttft["total_response_time"] <= total["total_response_time"]  # the first token comes before the end


def test_locust_counts_a_stream_that_ends_in_an_error_event_as_a_failed_total(tmp_path: Path) -> None:
    engine = FakeEngine(["Hello", ",", " world", "!"], fail_after=1, context_length=1000)
    with running(create_app(Settings(warmup=False), engine)) as base:
        rows = _locust(base, tmp_path)
    post, ttft, total = rows[("POST", "/stream")], rows[("SSE", "TTFT")], rows[("SSE", "total")]
    assert (post["num_requests"], post["num_failures"]) == (USERS * EACH, 0)  # the headers were a 200
    assert (ttft["num_requests"], ttft["num_failures"]) == (USERS * EACH, 0)  # one token came before the failure
    assert (total["num_requests"], total["num_failures"]) == (USERS * EACH, USERS * EACH)
