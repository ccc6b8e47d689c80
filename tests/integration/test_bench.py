"""`ttft-sse bench` against real servers: the real model over both protocols, a failing engine, servers that cut
the connection, and a cold-started `ttft-sse serve` process.

Nothing here asserts how fast anything was: only what was measured, counted and written.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.servers import free_port, running
from ttft_sse.__main__ import main
from ttft_sse.app import create_app
from ttft_sse.bench import load, prompts, soak
from ttft_sse.bench.client import Record, Target
from ttft_sse.bench.protocol import Lengths
from ttft_sse.engine.fake import FakeEngine
from ttft_sse.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"
SHORT = prompts.parse('{"name": "capital", "prompt": "What is the capital of France?"}\n', source="test")


def _plan(*targets: Target, modes: tuple[Any, ...] = ("stream", "batch"), requests: int = 2, **kw: Any) -> load.Plan:
    return load.Plan(
        targets=targets,
        modes=modes,
        concurrency=kw.pop("concurrency", (1,)),
        prompts=tuple(kw.pop("prompts", SHORT)),
        max_tokens=kw.pop("max_tokens", Lengths(8, 8)),
        requests=requests,
        timeout_s=kw.pop("timeout_s", 60.0),
    )


def _records(plan: load.Plan) -> list[Record]:
    runs = asyncio.run(load.run(plan, epoch=time.perf_counter()))
    return [r for run in runs for r in run.records]


# -- the real model, both protocols, the whole command -----------------------------------------------------------


@pytest.fixture(scope="module")
def bench_run(hf_server: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, Path]:
    """One `ttft-sse bench` over both protocols and both modes at two levels, against the real model."""
    out = tmp_path_factory.mktemp("bench")
    args = ["bench", "--url", hf_server, "--url", hf_server, "--protocol", "native", "--protocol", "openai"]
    args += [
        "--mode",
        "stream,batch",
        "--concurrency",
        "1,2",
        "--requests",
        "2",
        "--max-tokens",
        "8",
        "--same-prompts",  # both protocols and modes get the very same prompts, to agree on their tokens below
        "--out",
        str(out),
    ]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main(args) == 0
    document = json.loads((out / "results.json").read_text())
    return document, stdout.getvalue(), out


def test_both_protocols_measure_every_request_of_the_real_model_and_agree_on_its_tokens(
    bench_run: tuple[dict[str, Any], str, Path],
) -> None:
    document, _, _ = bench_run
    records = document["records"]
    assert len(records) == 2 * 2 * 2 * 2  # targets x modes x levels x requests
    assert {r["outcome"] for r in records} == {"ok"}, [r["error"] for r in records if r["error"]]
    for r in records:
        assert r["status"] == 200 and r["ttft_ms"] > 0 and r["total_ms"] >= r["ttft_ms"] >= 0
        assert 1 <= r["completion_tokens"] <= 8
        if r["mode"] == "stream":
            assert r["chunks"] >= 1 and len(r["gaps_ms"]) == r["chunks"] - 1  # a gap between each two text events
        else:
            assert (r["chunks"], r["gaps_ms"], r["ttft_ms"]) == (0, [], r["ttft_ms"])
    # Greedy and the same prompt: every protocol and mode generated the same number of tokens.
    assert len({r["completion_tokens"] for r in records}) == 1
    assert {t["model"] for t in document["targets"]} == {None, "SmolLM2-135M-Instruct"}  # discovered at /v1/models


def test_the_results_document_has_its_schema_summary_and_comparisons(
    bench_run: tuple[dict[str, Any], str, Path],
) -> None:
    document, _, _ = bench_run
    assert document["schema"] == "ttft-sse-bench/1"
    assert set(document) >= {"started_at", "finished_at", "command", "host", "config", "targets", "summary"}
    assert set(document) >= {"comparisons", "records", "cold_start", "soak"}
    assert document["command"][:2] == ["ttft-sse", "bench"]
    assert document["host"]["cpus"] == os.cpu_count() and len(document["host"]["loadavg_start"]) == 3
    assert document["config"]["schedule"] == "rounds" and document["config"]["concurrency"] == [1, 2]
    assert document["config"]["temperature"] == 0  # greedy unless --temperature says otherwise
    assert document["config"]["max_tokens"] == 8 and document["config"]["prompts"]["tag"] is None
    assert {r["max_tokens"] for r in document["records"]} == {8}
    rows = document["summary"]
    assert [(r["concurrency"], r["protocol"], r["mode"]) for r in rows] == [
        (c, p, m) for c in (1, 2) for p in ("native", "openai") for m in ("stream", "batch")
    ]
    for row in rows:
        assert (row["requests"], row["ok"], row["errors"], row["outcomes"]) == (2, 2, 0, {"ok": 2})
        assert set(row["ttft_ms"]) == {"n", "p50", "p90", "p99", "mean", "min", "max"}
        assert row["tokens_per_s"] > 0 and row["requests_per_s"] > 0
    kinds = [(c["kind"], c["concurrency"]) for c in document["comparisons"]]
    assert kinds.count(("batch_over_stream", 1)) == 2 and kinds.count(("target_over_baseline", 2)) == 2
    assert document["cold_start"] is None and document["soak"] is None


def test_the_table_is_printed_and_the_charts_are_pngs(bench_run: tuple[dict[str, Any], str, Path]) -> None:
    _, stdout, out = bench_run
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("c  target"))  # after the server's log lines
    assert lines[start].split()[:4] == ["c", "target", "mode", "ok/n"]
    assert [line.split()[4] for line in lines[start + 1 : start + 9]] == ["2/2"] * 8
    assert lines[start + 9].startswith("c=1 ")  # the comparisons follow the table
    assert "streamed vs" in stdout and "TTFT p50" in stdout
    for name in ("ttft.png", "concurrency.png"):
        assert (out / name).read_bytes()[:8] == PNG
    assert not (out / "soak.png").exists()


# -- failures are counted, not hidden ----------------------------------------------------------------------------


def test_a_failing_engine_is_counted_as_error_events_and_http_500s_on_both_protocols() -> None:
    engine = FakeEngine(["a", " b", " c", " d"], fail_after=2, context_length=1000)
    with running(create_app(Settings(warmup=False), engine)) as base:
        native, openai = Target(base, "native", "n"), Target(base, "openai", "o", model="fake")
        records = _records(_plan(native, openai, requests=2))
    got = sorted((r.target, r.mode, r.outcome, r.status) for r in records)
    assert got == sorted(
        [(t, "stream", "error_event", 200) for t in ("n", "o")] * 2
        + [(t, "batch", "http_status", 500) for t in ("n", "o")] * 2
    )
    for r in records:
        if r.mode == "stream":  # two pieces arrived before the failure: measured, but the request is not ok
            assert (r.chunks, r.ttft_ms is not None, r.error) == (2, True, "generation failed: scripted engine failure")
        else:
            assert r.error == "HTTP 500: generation failed: scripted engine failure"


def _sse_chunk(proto: str) -> bytes:
    if proto == "native":
        return b'event: token\r\nid: 0\r\ndata: {"text":"Hi"}\r\n\r\n'
    return b'data: {"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}\n\n'


@contextmanager
def cutting_server(proto: str, *, clean_end: bool) -> Iterator[str]:
    """A raw HTTP/1.1 server that starts a 200 SSE response, sends one token, and then ends it: abruptly (the
    connection closes inside the chunked body) or cleanly (a complete body that never says done / [DONE])."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.05)  # accept() wakes up to look at `stop`: closing a socket does not interrupt it
    port = listener.getsockname()[1]
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(10)
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, _, body = data.partition(b"\r\n\r\n")
                length = int(
                    next(h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
                )
                while len(body) < length:
                    body += conn.recv(65536)
                chunk = _sse_chunk(proto)
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                    + f"{len(chunk):x}\r\n".encode()
                    + chunk
                    + b"\r\n"
                    + (b"0\r\n\r\n" if clean_end else b"")
                )

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop.set()
        thread.join(10)
        listener.close()


@pytest.mark.parametrize("proto", ["native", "openai"])
def test_a_connection_cut_mid_stream_is_counted_as_dropped(proto: Any) -> None:
    with cutting_server(proto, clean_end=False) as base:
        [record] = _records(_plan(Target(base, proto, "cut", model="m"), modes=("stream",), requests=1))
    assert (record.outcome, record.status, record.chunks) == ("dropped", 200, 1)
    assert record.ttft_ms is not None  # the token before the cut was timed
    assert record.error is not None and record.error.startswith("RemoteProtocolError")


@pytest.mark.parametrize(("proto", "missing"), [("native", "done"), ("openai", "a finish_reason and data: [DONE]")])
def test_a_stream_that_ends_without_its_final_event_is_counted_as_dropped(proto: Any, missing: str) -> None:
    with cutting_server(proto, clean_end=True) as base:
        [record] = _records(_plan(Target(base, proto, "short", model="m"), modes=("stream",), requests=1))
    assert (record.outcome, record.chunks, record.error) == ("dropped", 1, f"the stream ended before {missing}")


def test_a_server_that_is_not_there_is_counted_as_transport_errors() -> None:
    target = Target(f"http://127.0.0.1:{free_port()}", "native", "gone")
    records = _records(_plan(target, requests=2))
    assert [(r.outcome, r.status, r.headers_ms) for r in records] == [("transport_error", None, None)] * 4
    assert all(r.error is not None and r.error.startswith("ConnectError") for r in records)


def test_failures_show_in_the_table_by_kind(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gone = f"http://127.0.0.1:{free_port()}"
    args = ["bench", "--url", gone, "--concurrency", "1", "--requests", "3", "--out", str(tmp_path), "--no-charts"]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    row = lines[lines.index(next(line for line in lines if line.startswith("c  target"))) + 1]
    assert row.split()[4] == "0/3" and row.endswith("3 (transport_error 3)")
    assert json.loads((tmp_path / "results.json").read_text())["summary"][0]["outcomes"] == {"transport_error": 3}


def test_an_api_key_is_sent_as_a_bearer_token_and_kept_out_of_the_results(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key = "bench-key-0001"
    app = create_app(Settings(warmup=False, api_keys=key), FakeEngine(["a", " b"], context_length=1000))
    with running(app) as base:
        common = ["bench", "--url", base, "--url", base, "--protocol", "native", "--protocol", "openai"]
        common += ["--concurrency", "1", "--requests", "2", "--no-charts", "--model", "fake"]
        assert main([*common, "--out", str(tmp_path / "without")]) == 0
        assert main([*common, "--api-key", key, "--out", str(tmp_path / "with")]) == 0
    capsys.readouterr()
    without = json.loads((tmp_path / "without" / "results.json").read_text())
    assert {(r["outcome"], r["status"]) for r in without["records"]} == {("http_status", 401)}  # counted, not hidden
    with_key = (tmp_path / "with" / "results.json").read_text()
    assert {r["outcome"] for r in json.loads(with_key)["records"]} == {"ok"}
    assert key not in with_key
    command = json.loads(with_key)["command"]
    assert command[command.index("--api-key") + 1] == "***"


# -- cold start and soak against a real `ttft-sse serve` process --------------------------------------------------


def test_cold_start_measures_a_real_serve_process_then_soaks_it_and_stops_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    monkeypatch.chdir(ROOT)  # the command runs this checkout's ttft_sse
    monkeypatch.setenv("TTFT_LOG_FORMAT", "json")
    command = f"{sys.executable} -m ttft_sse serve --port {port} --threads 1"
    # --protocol openai: the model name is looked up at /v1/models once the started server is up.
    args = ["bench", "--url", f"http://127.0.0.1:{port}", "--protocol", "openai", "--cold-start", command]
    args += ["--cold-starts", "1", "--steady", "2"]
    args += ["--concurrency", "1", "--requests", "1", "--max-tokens", "2-6", "--out", str(tmp_path)]
    args += ["--soak", "--soak-requests", "4", "--soak-every", "2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    document = json.loads((tmp_path / "results.json").read_text())

    [trial] = document["cold_start"]["trials"]
    assert trial["ready_ms"] > 0 and trial["exit_code"] == 0  # stopped with SIGTERM: drained and exited cleanly
    assert {"imports_ms", "tokenizer_ms", "model_ms", "warmup_ms", "total_ms"} <= set(trial["startup"])
    assert trial["first"]["outcome"] == "ok" and trial["first_ttft_ms"] == trial["first"]["ttft_ms"]
    assert trial["first"]["protocol"] == "openai" and document["targets"][0]["model"] == "SmolLM2-135M-Instruct"
    assert [r["outcome"] for r in trial["steady"]] == ["ok", "ok"] and trial["steady_ttft_ms"] > 0
    with pytest.raises(ProcessLookupError):
        os.kill(trial["pid"], 0)  # the process it started is gone
    assert "process start -> ready" in out and "warmup_ms" in out

    soak = document["soak"]
    assert soak["pid"] == trial["pid"]
    assert [s["after_requests"] for s in soak["samples"]] == [0, 2, 4]
    assert soak["summary"]["rss_source"] == "metrics"  # the server's own gauge comes first
    assert all(s["rss_bytes"] > 200 * 2**20 for s in soak["samples"])  # the 135M-parameter model is resident
    assert [r["outcome"] for r in soak["records"]] == ["ok"] * 4
    # Each request asked for its own max_tokens out of 2-6, and the real model kept to it.
    assert document["config"]["max_tokens"] == [2, 6] and len(document["config"]["prompts"]["tag"]) == 6
    lengths = Lengths(2, 6)
    for r in [trial["first"], *trial["steady"], *document["records"], *soak["records"]]:
        assert r["max_tokens"] == lengths.at(r["index"]) and 1 <= r["completion_tokens"] <= r["max_tokens"]
    assert [r["max_tokens"] for r in soak["records"]] == [2, 5, 3, 6]
    assert (tmp_path / "soak.png").read_bytes()[:8] == PNG
    assert (tmp_path / "cold-start-1.log").stat().st_size > 0


def test_cold_start_refuses_a_url_where_a_server_already_answers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with running(create_app(Settings(warmup=False), FakeEngine())) as base:
        args = ["bench", "--url", base, "--cold-start", "true", "--out", str(tmp_path)]
        assert main(args) == 1
    assert "something already answers at" in capsys.readouterr().err


class Recording:
    """An ASGI app in front of another that keeps the JSON body of every request it passes on."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.bodies: list[dict[str, Any]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        chunks: list[bytes] = []

        async def receive_body() -> Any:
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    self.bodies.append(json.loads(b"".join(chunks)))
            return message

        await self.app(scope, receive_body, send)


def test_every_request_sent_is_a_new_conversation_asking_for_its_own_max_tokens() -> None:
    app = Recording(create_app(Settings(warmup=False), FakeEngine(["a", " b"], context_length=1000)))
    system = {"role": "system", "content": "Be brief."}
    asked = prompts.Prompt("asked", (system, {"role": "user", "content": "Name a colour."}))
    lengths = Lengths(3, 40)
    with running(app) as base:
        native, openai = Target(base, "native", "n"), Target(base, "openai", "o", model="fake")
        plan = load.Plan(
            targets=(native, openai),
            modes=("stream", "batch"),
            concurrency=(1, 2),
            prompts=(asked,),
            max_tokens=lengths,
            requests=3,
            prompt_tag="run1",
        )
        records = _records(plan)
    assert len(records) == len(app.bodies) == 2 * 2 * 2 * 3 and {r.outcome for r in records} == {"ok"}
    questions = [body["messages"][-1]["content"] for body in app.bodies]
    assert len(set(questions)) == len(questions)  # the server never saw a prompt twice
    arms = {("n", "stream"): "", ("n", "batch"): "-1", ("o", "stream"): "-2", ("o", "batch"): "-3"}
    sent = {q: body["max_tokens"] for q, body in zip(questions, app.bodies, strict=True)}
    for r in records:
        question = f"Request run1-{r.concurrency}-{r.index}{arms[(r.target, r.mode)]}: Name a colour."
        assert sent[question] == r.max_tokens == lengths.at(r.index)
    assert all(body["messages"][0] == system for body in app.bodies)  # the system prompt is shared as it was


def test_duration_runs_every_arm_for_at_least_that_long_in_whole_rounds() -> None:
    engine = FakeEngine(["a", " b", " c"], delay=0.01, context_length=1000)
    with running(create_app(Settings(warmup=False), engine)) as base:
        target = Target(base, "native", "n")
        plan = load.Plan(
            targets=(target,),
            modes=("stream", "batch"),
            concurrency=(2,),
            prompts=SHORT,
            max_tokens=Lengths(8, 8),
            duration_s=0.2,
        )
        runs = asyncio.run(load.run(plan, epoch=time.perf_counter()))
    assert [(run.mode, run.concurrency) for run in runs] == [("stream", 2), ("batch", 2)]
    for run in runs:
        assert run.active_s >= 0.2  # rounds go on until every arm has had its duration
        assert len(run.records) >= 2 and len(run.records) % 2 == 0  # whole rounds of c requests
        assert {r.outcome for r in run.records} == {"ok"}
    assert len(runs[0].records) == len(runs[1].records)  # both arms got the same prompts, round for round


def test_rss_comes_from_proc_when_there_is_no_metrics_endpoint_and_the_pid_is_known() -> None:
    gone = f"http://127.0.0.1:{free_port()}"

    async def sources() -> list[str]:
        async with httpx.AsyncClient(timeout=2) as client:
            with_pid = soak.RSSReader(gone, os.getpid())
            chosen = [await with_pid.choose(client), await soak.RSSReader(gone, None).choose(client)]
            rss = await with_pid.read(client)
            assert rss is not None and rss > 10 * 2**20
            return chosen

    assert asyncio.run(sources()) == ["proc", "none"]
