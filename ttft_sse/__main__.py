"""Command line: ``ttft-sse serve`` runs the server under hypercorn; ``ttft-sse prepare`` converts the model once;
``ttft-sse worker`` runs overflow jobs from Redis (a Celery worker, one model per pool process); ``ttft-sse bench``
measures a running server (this one or any OpenAI-compatible one) from the outside."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import structlog

from ttft_sse import __version__, log
from ttft_sse.bench import cli as bench_cli
from ttft_sse.errors import StartupError
from ttft_sse.settings import Settings, SettingsError

if TYPE_CHECKING:
    from hypercorn.config import Config

    from ttft_sse.runtime import Runtime


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ttft-sse", description="LLM streaming server built for time-to-first-token.")
    parser.add_argument("--version", action="version", version=f"ttft-sse {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="load and warm the model, then serve HTTP (SSE) requests")
    serve.add_argument("--host", help="address to bind (TTFT_HOST, default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to bind (TTFT_PORT, default 8000)")
    serve.add_argument("--model", help="bundled, a .gguf file, a model directory or a model id (TTFT_MODEL)")
    serve.add_argument(
        "--engine", help="batched (shared forward passes), single, llamacpp (a GGUF on llama.cpp) or auto (TTFT_ENGINE)"
    )
    serve.add_argument("--device", help="auto, cpu, cuda, cuda:N (TTFT_DEVICE)")
    serve.add_argument("--dtype", help="auto, float32, bfloat16, float16 (TTFT_DTYPE)")
    serve.add_argument("--threads", type=int, help="torch threads; 0 = half the cores (TTFT_THREADS)")
    prepare = commands.add_parser("prepare", help="convert the model into the cache so that serve starts fast")
    prepare.add_argument("--model", help="as for serve (TTFT_MODEL)")
    prepare.add_argument("--engine", help="as for serve (TTFT_ENGINE); with auto, measure the engines once")
    worker = commands.add_parser("worker", help="run jobs queued in Redis (TTFT_REDIS_URL): a Celery worker")
    worker.add_argument("--redis-url", dest="redis_url", help="the queue's Redis, as the servers use (TTFT_REDIS_URL)")
    worker.add_argument(
        "--concurrency",
        dest="job_runners",
        type=int,
        help="pool processes, each with its own model (TTFT_JOB_RUNNERS, default 1)",
    )
    for flag in ("model", "device", "dtype"):
        worker.add_argument(f"--{flag}", help=f"as for serve (TTFT_{flag.upper()})")
    worker.add_argument("--threads", type=int, help="torch threads per pool process (TTFT_THREADS)")
    bench = commands.add_parser(
        "bench",
        help="measure TTFT, inter-token latency and throughput of a server (ours or OpenAI-compatible)",
        description="Load one or two servers and report TTFT, inter-token latency, total time, tokens/s and errors "
        "as a table, results.json and PNG charts. See docs/performance.md.",
    )
    bench_cli.add_arguments(bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "bench":  # a client: no server settings, no server logging
        try:
            return bench_cli.main(args, argv)
        except KeyboardInterrupt:
            return 130
    overrides = {k: v for k, v in vars(args).items() if k != "command"}
    try:
        settings = Settings.from_env(**overrides)
        if args.command == "serve" and settings.warm_prompts:
            from ttft_sse.prefixes import warm_prompts

            warm_prompts.check(settings.warm_prompts)  # a bad file is refused now, with the line that is wrong
    except SettingsError as exc:
        print(f"ttft-sse: {exc}", file=sys.stderr)
        return 2
    log.configure(level=settings.log_level, fmt=settings.log_format)
    try:
        if args.command == "prepare":
            return _prepare(settings)
        if args.command == "worker":
            return _worker(settings)
        return asyncio.run(_serve(settings))
    except StartupError as exc:
        print(f"ttft-sse: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _prepare(settings: Settings) -> int:
    from ttft_sse.engine.loading import model, sources
    from ttft_sse.stages import StageClock

    clock = StageClock()
    source = sources.resolve(settings.model)
    model.start_builds(settings, source)  # compiled beside reading the metadata and laying the weights out
    location = sources.materialize(source, settings.cache_dir, clock)
    if source.kind == "gguf":
        from ttft_sse.engine.kernels import argmax
        from ttft_sse.engine.kernels.compiler import KERNEL_DIR
        from ttft_sse.engine.loaded import LoadedModel

        # Loaded once here too: on CPU that reads the file's blocks behind the layers, lays them out for the block
        # kernel and keeps them in the cache directory (engine/kernels/kernel.py, engine/kernels/arrangement.py), and
        # builds the attention (engine/kernels/attention.py) for the server's start; and the batched engine's greedy
        # pick (engine/kernels/argmax.py).
        loaded = LoadedModel(settings)
        loaded.load(clock)
        if loaded.model.device.type == "cpu":
            argmax.build(settings.cache_dir / KERNEL_DIR)
    if settings.engine == "auto":
        from ttft_sse.engine import choice

        # The faster engine for this file, measured once and kept in the model's cache folder (engine/choice.py).
        chosen = choice.choose(settings)
        structlog.get_logger("ttft_sse.prepare").info("engine_chosen", **chosen.as_dict())
    structlog.get_logger("ttft_sse.prepare").info("prepared", model=settings.model, path=location, **clock.as_dict())
    print(location)
    return 0


def _worker(settings: Settings) -> int:
    if not settings.redis_url:
        print("ttft-sse: worker needs the queue's Redis: set TTFT_REDIS_URL or pass --redis-url", file=sys.stderr)
        return 2
    from ttft_sse.engine.loading import sources
    from ttft_sse.worker import run_worker

    sources.resolve(settings.model)  # a model that cannot be found fails here, not in every pool process
    return run_worker(settings, concurrency=settings.job_runners)


def hypercorn_config(settings: Settings) -> Config:
    """The hypercorn settings ``serve`` runs with; ``deploy/hypercorn.toml`` writes the same down (a test checks).

    The transport's limits (keep-alive, request heads) come from :mod:`ttft_sse.http.transport`, which also puts its
    reader into hypercorn: building the config is what makes a server run with them.
    """
    from ttft_sse.http import transport
    from ttft_sse.runtime import FLUSH_SECONDS

    config = transport.config(
        keep_alive_seconds=settings.keep_alive_seconds,
        max_header_bytes=settings.max_header_bytes,
        header_timeout_seconds=settings.header_timeout_seconds,
    )
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    config.bind = [f"{host}:{settings.port}"]
    config.accesslog = None  # the RequestContext middleware logs each request, with its id
    # Hypercorn's own grace starts only when the shutdown trigger returns, which is after our drain
    # (Runtime.drain): by then every stream has its final event, and this is only the time to write it.
    config.graceful_timeout = FLUSH_SECONDS
    return config


def _check_listen(config: Config) -> None:
    """Bind the addresses once and let them go, before anything loads: hypercorn binds them only after the
    lifespan's start, and a port in use then ends the process with hypercorn's traceback."""
    try:
        sockets = config.create_sockets()
    except OSError as exc:
        raise StartupError(f"cannot listen on {', '.join(config.bind)}: {exc.strerror or exc}") from None
    for sock in (*sockets.secure_sockets, *sockets.insecure_sockets, *sockets.quic_sockets):
        sock.close()


async def shutdown_trigger(runtime: Runtime, stop: asyncio.Event) -> None:
    """Hypercorn's shutdown trigger: wait for ``stop`` (SIGTERM / SIGINT) or a failed load, then drain.

    Hypercorn keeps accepting connections until this returns, which is what lets a draining server still answer
    ``/readyz`` (503) and refuse new generations with 503 + Retry-After instead of resetting connections.
    """
    failed = asyncio.ensure_future(runtime.lifecycle.failed.wait())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({failed, stopping}, return_when=asyncio.FIRST_COMPLETED)
    for task in (failed, stopping):
        task.cancel()
    log = structlog.get_logger("ttft_sse.main")
    log.info("shutting_down", state=runtime.lifecycle.state, drain_s=runtime.settings.drain_seconds)
    await runtime.drain(runtime.settings.drain_seconds)


async def _serve(settings: Settings) -> int:
    from hypercorn.asyncio import serve

    from ttft_sse.app import create_app

    app = create_app(settings)
    runtime: Runtime = app.state.runtime
    config = hypercorn_config(settings)

    stop = asyncio.Event()

    def on_signal() -> None:
        if stop.is_set():
            runtime.hurry()  # a second signal: do not wait out the grace
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)

    asgi: Any = app  # hypercorn's own ASGI types do not name Starlette; it is a plain ASGI app
    _check_listen(config)
    await serve(asgi, config, shutdown_trigger=partial(shutdown_trigger, runtime, stop))
    structlog.get_logger("ttft_sse.main").info("stopped", state=runtime.lifecycle.state)
    if runtime.lifecycle.state == "failed":
        print(f"ttft-sse: the model failed to load: {runtime.lifecycle.error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
