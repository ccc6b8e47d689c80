#!/usr/bin/env python3
"""Build the container image on a Debian base made here, run it, stream one answer, stop it: the Dockerfile, for real.

Stages, each timed and printed:

* base: a ``debootstrap --variant=minbase`` root of Debian with Python (no registry needed), made once and cached as
  a tarball under ``~/.cache/ttft-sse/image-base``; ``podman import`` makes it an image when podman lacks it.
* build: ``buildah bud --isolation chroot`` of this checkout's Dockerfile with ``BASE`` set to that image (docker
  format, so that the HEALTHCHECK is kept; layers cached, so an unchanged checkout rebuilds in seconds).
* run: ``podman run`` (runc) with the port published on loopback.
* ready: ``/readyz`` 200 within ``--ready-timeout``, then the image's own HEALTHCHECK passes
  (``podman healthcheck run``).
* stream: ``GET /stream`` greedy: token events numbered from 0, then ``done``, nothing else, the answer non-empty and
  the same text as ``POST /complete`` gives.
* stop: ``podman stop`` sends the image's STOPSIGNAL (SIGTERM); the server drains and exits 0 within its shutdown
  budget.

Podman and buildah read ``containers.conf`` beside this file (``CONTAINERS_CONF``), never the user's own. The build
sees the pip configuration of the Python that runs this script (``pip config list``: a mirror, find-links, a CA
bundle) as ``/etc/pip.conf``, and every local path it names, read-only at the same path: a machine whose packages
come from a mirror builds as ``make install`` does there. Nothing of either is copied into the image's files (only
their empty mount points stay).

Needs root (debootstrap, rootful podman) and ``apt-get install podman buildah runc debootstrap``. Exits 0 when every
stage passes, 1 with a line naming the stage that failed (and the container's log, once it runs) otherwise.

    python deploy/image/check.py [--torch-index URL] [--no-cache] [--keep]     # or: make image-check
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CONTAINERS_CONF = HERE / "containers.conf"
DEFAULT_CACHE = Path.home() / ".cache" / "ttft-sse" / "image-base"

SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
# What the Dockerfile needs of its base beyond apt-get: python3 with its venv module.
PACKAGES = ("python3", "python3-venv")
BASE_REPOSITORY = "localhost/ttft-sse-base"
IMAGE = "localhost/ttft-sse:check"
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
TOOLS = ("debootstrap", "podman", "buildah", "runc")

# The server's default TTFT_DRAIN_SECONDS and what a SIGTERM may take with it: the grace, the cut, the flush
# (ttft_sse.runtime.shutdown_budget; tests/test_image_check.py keeps the two equal).
DRAIN_SECONDS = 10.0
STOP_BUDGET_SECONDS = DRAIN_SECONDS + 5.0 + 5.0
PROMPT = "What is the capital of France?"
MAX_TOKENS = 24


class CheckFailed(Exception):
    """A stage did not do what it must; the message says what was seen."""


# -- what the steps print -------------------------------------------------------------------------------------------


@dataclass
class Stage:
    name: str
    seconds: float
    detail: str


class Timings:
    """Each stage's wall time and one line of what it did, printed as it ends and again as a table at the end."""

    def __init__(self) -> None:
        self.stages: list[Stage] = []

    @contextmanager
    def stage(self, name: str) -> Iterator[list[str]]:
        """Times the block; the block appends its one-line detail to the list it is given."""
        print(f"== {name}", flush=True)
        detail: list[str] = []
        started = time.monotonic()
        try:
            yield detail
        except CheckFailed as exc:
            raise CheckFailed(f"{name}: {exc}") from None
        finally:
            seconds = time.monotonic() - started
            self.stages.append(Stage(name, seconds, "; ".join(detail)))
            print(f"   {name}: {seconds:.1f} s  {'; '.join(detail)}", flush=True)

    def table(self) -> str:
        width = max(len(stage.name) for stage in self.stages)
        rows = [f"  {s.name:<{width}}  {s.seconds:7.1f} s  {s.detail}" for s in self.stages]
        total = sum(stage.seconds for stage in self.stages)
        return "\n".join([*rows, f"  {'total':<{width}}  {total:7.1f} s"])


# -- the pieces, each testable without podman -----------------------------------------------------------------------


def pip_sources(listing: str) -> tuple[str, list[Path]]:
    """The pip configuration that ``pip config list`` printed, as one config file, and the local paths it names.

    Each line reads ``section.key='value'``; settings from the environment (section ``:env:``) apply to every command,
    so they go to ``[global]`` and win over a file's. A path is a value's word that is absolute or a ``file:`` URL
    and exists; an index directory named ``simple`` brings its parent, where such mirrors keep the files its pages
    link to. Paths inside another listed path are left out (the outer mount carries them)."""
    sections: dict[str, dict[str, str]] = {}
    from_env: dict[str, str] = {}
    for line in listing.splitlines():
        name, sep, quoted = line.partition("=")
        if not sep or "." not in name:
            continue
        section, _, key = name.rpartition(".")
        value = str(ast.literal_eval(quoted))
        if section == ":env:":
            from_env[key] = value
        else:
            sections.setdefault(section, {})[key] = value
    sections.setdefault("global", {}).update(from_env)
    lines: list[str] = []
    for section, values in sections.items():
        if values:
            lines.append(f"[{section}]")
            lines.extend(f"{key} = {value}" for key, value in values.items())
    paths: set[Path] = set()
    for values in sections.values():
        for word in " ".join(values.values()).split():
            raw = urllib.parse.unquote(urllib.parse.urlparse(word).path) if word.startswith("file:") else word
            if not raw.startswith("/"):
                continue
            path = Path(raw)
            if path.exists():
                paths.add(path.parent if path.is_dir() and path.name == "simple" else path)
    outer = sorted(p for p in paths if not any(q != p and p.is_relative_to(q) for q in paths))
    return ("\n".join(lines) + "\n" if lines else ""), outer


@dataclass(frozen=True)
class Event:
    name: str
    id: str | None
    data: str


def sse_events(lines: Sequence[str]) -> list[Event]:
    """Server-sent events from the body's lines: ``event``, ``id`` and ``data`` fields, a blank line ends each;
    comments (pings) and events without data are skipped."""
    events: list[Event] = []
    name: str = "message"
    event_id: str | None = None
    data: list[str] = []
    for line in [*lines, ""]:
        if not line:
            if data:
                events.append(Event(name, event_id, "\n".join(data)))
            name, event_id, data = "message", None, []
        elif not line.startswith(":"):
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "event":
                name = value
            elif field == "id":
                event_id = value
            elif field == "data":
                data.append(value)
    return events


def streamed_answer(events: Sequence[Event]) -> tuple[str, dict[str, Any]]:
    """The text of a finished ``/stream`` and its ``done`` data; raises CheckFailed unless the events are tokens
    numbered 0, 1, 2, ... and then one ``done``, and the text is more than whitespace."""
    names = [event.name for event in events]
    if not names or names[-1] != "done" or set(names[:-1]) != {"token"}:
        raise CheckFailed(f"expected token events and then done, got {names}")
    tokens = events[:-1]
    ids = [event.id for event in tokens]
    if ids != [str(i) for i in range(len(tokens))]:
        raise CheckFailed(f"token ids are not 0, 1, 2, ...: {ids}")
    text = "".join(json.loads(event.data)["text"] for event in tokens)
    if not text.strip():
        raise CheckFailed(f"the answer is empty: {text!r}")
    done: dict[str, Any] = json.loads(events[-1].data)
    if done.get("finish_reason") not in ("stop", "length"):
        raise CheckFailed(f"done says finish_reason {done.get('finish_reason')!r}")
    return text, done


def base_tag(suite: str, mirror: str) -> str:
    """The base image's tag: the suite and a digest of everything that makes the root, so a change makes another."""
    digest = hashlib.sha256(f"{suite} minbase {','.join(PACKAGES)} {mirror}".encode()).hexdigest()[:12]
    return f"{BASE_REPOSITORY}:{suite}-{digest}"


# -- the stages -----------------------------------------------------------------------------------------------------


def run(args: Sequence[str], env: Mapping[str, str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(args), env=dict(env), capture_output=True, text=True)
    if check and done.returncode != 0:
        raise CheckFailed(f"`{' '.join(args)}` exited {done.returncode}: {(done.stderr or done.stdout)[-2000:]}")
    return done


def logged(args: Sequence[str], env: Mapping[str, str], log: Path, *, show: tuple[str, ...] = ()) -> None:
    """Runs a long command with its output in ``log``, echoing the lines that start with one of ``show``; on failure
    the log's tail is part of the message."""
    with (
        log.open("w") as out,
        subprocess.Popen(
            list(args), env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as proc,
    ):
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            if show and line.startswith(show):
                print(f"   {line.rstrip()[:150]}", flush=True)
    if proc.returncode != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-40:])
        raise CheckFailed(f"`{args[0]} {args[1]}` exited {proc.returncode} (all of it in {log}):\n{tail}")


def make_base(cache: Path, suite: str, mirror: str, env: Mapping[str, str], detail: list[str]) -> str:
    tag = base_tag(suite, mirror)
    if run(["podman", "image", "exists", tag], env, check=False).returncode == 0:
        detail.append(f"{tag} already in podman's storage")
        return tag
    cache.mkdir(parents=True, exist_ok=True)
    tarball = cache / f"{tag.rpartition(':')[2]}.tar"
    if tarball.exists():
        detail.append(f"cached root {tarball}")
    else:
        root = Path(tempfile.mkdtemp(prefix="root-", dir=cache))
        try:
            include = ",".join(PACKAGES)
            logged(
                ["debootstrap", "--variant=minbase", f"--include={include}", suite, str(root), mirror],
                env,
                cache / "debootstrap.log",
            )
            # The image runs apt-get update itself: the downloaded packages and lists would only add weight.
            for leftover in (*root.glob("var/cache/apt/archives/*.deb"), *root.glob("var/lib/apt/lists/*")):
                if leftover.is_file():
                    leftover.unlink()
            partial = tarball.with_suffix(".partial")
            run(["tar", "-C", str(root), "-cf", str(partial), "."], env)
            partial.rename(tarball)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        detail.append(f"debootstrap {suite} ({', '.join(PACKAGES)}) into {tarball}")
    changes = ["--change", f"ENV PATH={PATH}", "--change", "ENV LANG=C.UTF-8", "--change", 'CMD ["bash"]']
    run(["podman", "import", *changes, str(tarball), tag], env)
    detail.append(f"imported as {tag} ({tarball.stat().st_size / 2**20:.0f} MiB)")
    return tag


def build(
    base: str,
    torch_index: str | None,
    no_cache: bool,
    work: Path,
    log: Path,
    env: Mapping[str, str],
    detail: list[str],
) -> None:
    """Builds IMAGE on ``base``; ``work`` holds the pip configuration for the build's lifetime, ``log`` its output."""
    pip = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    conf, paths = pip_sources(pip.stdout if pip.returncode == 0 else "")
    volumes: list[str] = []
    if conf:
        (work / "pip.conf").write_text(conf)
        volumes += ["--volume", f"{work / 'pip.conf'}:/etc/pip.conf:ro"]
        for path in paths:
            volumes += ["--volume", f"{path}:{path}:ro"]
        detail.append(f"pip configuration and {', '.join(map(str, paths)) or 'no local paths'} mounted")
    args = ["--build-arg", f"BASE={base}"]
    if torch_index is not None:
        args += ["--build-arg", f"TORCH_INDEX={torch_index}"]
        detail.append(f"TORCH_INDEX={torch_index or '(pip configuration)'}")
    if no_cache:
        args.append("--no-cache")
    command = ["buildah", "bud", "--isolation", "chroot", "--format", "docker", "--layers", *args, *volumes]
    command += ["-f", str(ROOT / "Dockerfile"), "-t", IMAGE, str(ROOT)]
    logged(command, env, log, show=("STEP ", "--> Using cache"))
    (config,) = json.loads(run(["podman", "image", "inspect", IMAGE], env).stdout)
    user = config["Config"].get("User")
    if not user or user.split(":")[0] in ("0", "root"):
        raise CheckFailed(f"the image runs as {user!r}, not as a non-root user")
    if not config.get("Healthcheck"):
        raise CheckFailed("the image has no HEALTHCHECK")
    detail.append(f"{IMAGE}: {config['Size'] / 1e9:.2f} GB, user {user}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def state(name: str, env: Mapping[str, str]) -> dict[str, Any]:
    (container,) = json.loads(run(["podman", "container", "inspect", name], env).stdout)
    found: dict[str, Any] = container["State"]
    return found


def wait_ready(base: str, name: str, timeout: float, env: Mapping[str, str], detail: list[str]) -> None:
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{base}/readyz", timeout=5) as answer:
                ready = json.loads(answer.read())
                detail.append(f"weights {ready.get('weights')}, startup {ready['startup']['total_ms'] / 1000:.1f} s")
                break
        except urllib.error.HTTPError as exc:
            last = f"{exc.code} {exc.read()[:300]!r}"
        except (OSError, http.client.HTTPException) as exc:
            last = repr(exc)
        if not state(name, env)["Running"]:
            raise CheckFailed(f"the container stopped before /readyz said 200 (last: {last})")
        time.sleep(0.5)
    else:
        raise CheckFailed(f"/readyz not 200 within {timeout:.0f} s (last: {last})")
    health = run(["podman", "healthcheck", "run", name], env, check=False)
    if health.returncode != 0:
        raise CheckFailed(f"the image's HEALTHCHECK fails on a ready server: {health.stdout}{health.stderr}")
    detail.append("HEALTHCHECK healthy")


def stream_one(port: int, detail: list[str]) -> None:
    query = urllib.parse.urlencode({"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0})
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        connection.request("GET", f"/stream?{query}", headers={"Accept": "text/event-stream"})
        response = connection.getresponse()
        body = response.read().decode()
        kind = response.getheader("Content-Type", "")
        if response.status != 200 or not kind.startswith("text/event-stream"):
            raise CheckFailed(f"/stream answered {response.status} {kind}: {body[:500]}")
        text, done = streamed_answer(sse_events(body.splitlines()))
        connection.request(
            "POST",
            "/complete",
            json.dumps({"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}),
            headers={"Content-Type": "application/json"},
        )
        completed = json.loads(connection.getresponse().read())
    finally:
        connection.close()
    if completed.get("text") != text:
        raise CheckFailed(f"/complete answered {completed.get('text')!r}, /stream {text!r}")
    timings = done.get("timings", {})
    detail.append(f"{PROMPT!r} -> {text!r} ({done['finish_reason']}, first token {timings.get('ttft_ms')} ms)")


def stop(name: str, env: Mapping[str, str], detail: list[str]) -> None:
    started = time.monotonic()
    # podman sends the image's STOPSIGNAL, then SIGKILL once the budget (rounded up) has passed.
    run(["podman", "stop", "--time", str(int(STOP_BUDGET_SECONDS) + 1), name], env)
    seconds = time.monotonic() - started
    code = state(name, env)["ExitCode"]
    if code != 0:
        raise CheckFailed(f"exited {code} after {seconds:.1f} s (137: killed, its drain took over the budget)")
    if seconds > STOP_BUDGET_SECONDS:
        raise CheckFailed(f"took {seconds:.1f} s to exit, over its shutdown budget of {STOP_BUDGET_SECONDS:.0f} s")
    detail.append(f"SIGTERM -> exit 0 in {seconds:.1f} s (budget {STOP_BUDGET_SECONDS:.0f} s)")


def preflight() -> None:
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        raise CheckFailed(f"{', '.join(missing)} not found: apt-get install podman buildah runc debootstrap")
    if os.geteuid() != 0:
        raise CheckFailed("needs root (debootstrap makes the base; podman runs rootful): run it with sudo")


def check(options: argparse.Namespace, timings: Timings) -> None:
    preflight()
    env = {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}
    with tempfile.TemporaryDirectory(prefix="ttft-image-check-") as tmp:
        work = Path(tmp)
        with timings.stage("base") as detail:
            base = make_base(options.cache, options.suite, options.mirror, env, detail)
        with timings.stage("build") as detail:
            log = options.cache / "build.log"  # kept after the run, like debootstrap.log beside it
            build(base, options.torch_index, options.no_cache, work, log, env, detail)
        name = f"ttft-sse-check-{os.getpid()}"
        port = free_port()
        try:
            with timings.stage("run") as detail:
                run(["podman", "run", "--detach", "--name", name, "--publish", f"127.0.0.1:{port}:8000", IMAGE], env)
                detail.append(f"{name} on 127.0.0.1:{port}")
            with timings.stage("ready") as detail:
                wait_ready(f"http://127.0.0.1:{port}", name, options.ready_timeout, env, detail)
            with timings.stage("stream") as detail:
                stream_one(port, detail)
            with timings.stage("stop") as detail:
                stop(name, env, detail)
        except CheckFailed:
            logs = run(["podman", "logs", "--tail", "60", name], env, check=False)
            print(f"-- the container's log (last 60 lines):\n{logs.stdout}{logs.stderr}", file=sys.stderr)
            raise
        finally:
            if not options.keep:
                run(["podman", "rm", "--force", name], env, check=False)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--torch-index",
        help="the build's TORCH_INDEX: where torch's CPU wheel comes from ('' for pip's configuration; "
        "unset: the Dockerfile's default, PyTorch's CPU index)",
    )
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where the base's root tarball is kept")
    parser.add_argument("--suite", default=SUITE, help="the Debian release of the base")
    parser.add_argument("--mirror", default=MIRROR, help="the Debian mirror debootstrap reads")
    parser.add_argument("--ready-timeout", type=float, default=300.0, help="seconds for /readyz to say 200")
    parser.add_argument("--no-cache", action="store_true", help="rebuild every layer of the image")
    parser.add_argument("--keep", action="store_true", help="leave the stopped container for a look")
    options = parser.parse_args(argv)
    timings = Timings()
    started = time.monotonic()
    try:
        check(options, timings)
    except CheckFailed as exc:
        print(f"image check FAILED: {exc}", file=sys.stderr)
        if timings.stages:
            print(timings.table(), file=sys.stderr)
        return 1
    print(f"image check passed in {time.monotonic() - started:.0f} s:\n{timings.table()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
