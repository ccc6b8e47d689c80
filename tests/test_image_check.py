"""deploy/image/check.py's parts that need no podman: the pip configuration handed to the build, the SSE reading and
the answer's checks, the base's tag, the stop budget; and that ``make image-check`` and CI run it. The check itself
(minutes: it builds the image) runs from ``make image-check`` and ``.ci/run``, not from the suite."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

from ttft_sse.runtime import shutdown_budget
from ttft_sse.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "deploy" / "image" / "check.py"


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("image_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


check = load()


def test_pip_sources_merge_files_and_environment_and_mount_the_local_paths(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    (tmp_path / "pypi" / "simple").mkdir(parents=True)
    (wheels / "nested").mkdir(parents=True)
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("torch<=2.14.1\n")
    listing = "\n".join(
        [
            ":env:.default-timeout='180'",
            f":env:.find-links='{wheels}'",
            f"global.constraint='{constraints}'",
            f"global.extra-index-url='file://{tmp_path}/pypi/simple https://mirror.example/simple'",
            "global.find-links='/nowhere/wheels'",
            f"install.find-links='{wheels / 'nested'}'",
        ]
    )
    conf, paths = check.pip_sources(listing)
    assert conf == (
        "[global]\n"
        f"constraint = {constraints}\n"
        f"extra-index-url = file://{tmp_path}/pypi/simple https://mirror.example/simple\n"
        f"find-links = {wheels}\n"  # the environment's value wins over the file's
        "default-timeout = 180\n"
        "[install]\n"
        f"find-links = {wheels / 'nested'}\n"
    )
    # The index's parent (its pages link to ../../files), the constraints file, the wheels (which hold nested); not
    # what does not exist, nor URLs.
    assert paths == [constraints, tmp_path / "pypi", wheels]


def test_pip_sources_of_an_empty_configuration_mount_nothing() -> None:
    assert check.pip_sources("") == ("", [])


STREAM = """\
: ping

id: 0
event: token
data: {"text":"The"}

id: 1
event: token
data: {"text":" capital"}

event: done
data: {"finish_reason":"stop","usage":{"completion_tokens":3}}
"""


def test_sse_events_read_fields_and_skip_comments() -> None:
    events = check.sse_events(STREAM.splitlines())
    assert [(e.name, e.id) for e in events] == [("token", "0"), ("token", "1"), ("done", None)]
    assert events[1].data == '{"text":" capital"}'


def test_streamed_answer_is_the_tokens_joined() -> None:
    text, done = check.streamed_answer(check.sse_events(STREAM.splitlines()))
    assert text == "The capital"
    assert done["finish_reason"] == "stop"


def event(name: str, data: str, event_id: str | None = None) -> object:
    return check.Event(name, event_id, data)


@pytest.mark.parametrize(
    ("events", "message"),
    [
        ([], "expected token events and then done"),
        ([event("token", '{"text":"a"}', "0")], "expected token events and then done"),
        ([event("token", '{"text":"a"}', "0"), event("error", "{}")], "expected token events and then done"),
        ([event("done", '{"finish_reason":"stop"}')], "expected token events and then done"),
        ([event("token", '{"text":"a"}', "1"), event("done", '{"finish_reason":"stop"}')], "token ids"),
        ([event("token", '{"text":" \\n"}', "0"), event("done", '{"finish_reason":"stop"}')], "the answer is empty"),
        ([event("token", '{"text":"a"}', "0"), event("done", '{"finish_reason":"error"}')], "finish_reason 'error'"),
    ],
)
def test_streamed_answer_refuses_what_is_not_a_finished_answer(events: list[object], message: str) -> None:
    with pytest.raises(check.CheckFailed, match=re.escape(message)):
        check.streamed_answer(events)


def test_the_base_tag_changes_with_what_makes_the_root() -> None:
    tag = check.base_tag("bookworm", check.MIRROR)
    assert re.fullmatch(r"localhost/ttft-sse-base:bookworm-[0-9a-f]{12}", tag)
    assert tag == check.base_tag("bookworm", check.MIRROR)
    assert tag != check.base_tag("trixie", check.MIRROR)
    assert tag != check.base_tag("bookworm", "http://mirror.example/debian")


def test_the_stop_budget_is_the_servers_shutdown_budget() -> None:
    """The check fails a stop that takes longer than the server's own worst case, and no sooner."""
    assert Settings().drain_seconds == check.DRAIN_SECONDS
    assert shutdown_budget(check.DRAIN_SECONDS) == check.STOP_BUDGET_SECONDS


def test_make_and_ci_run_the_check_after_the_suite() -> None:
    makefile = (ROOT / "Makefile").read_text()
    target = re.search(r"^image-check:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert target is not None and "deploy/image/check.py" in target.group(1)
    ci = (ROOT / ".ci" / "run").read_text().replace("\\\n", " ")  # continuation lines joined
    assert re.search(r"apt-get install [^\n]*\bpodman\b[^\n]*\bbuildah\b[^\n]*\brunc\b[^\n]*\bdebootstrap\b", ci)
    commands = [line.strip() for line in ci.splitlines() if line.strip().startswith("make ")]
    assert commands[-2:][0] == "make test" and commands[-1].startswith("make image-check")
