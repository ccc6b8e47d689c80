"""Files written whole or not at all (engine/cache_files.py)."""

from __future__ import annotations

from pathlib import Path

from structlog.testing import capture_logs

from ttft_sse.engine.cache_files import write_whole


def test_a_file_is_written_whole_and_no_partial_is_left(tmp_path: Path) -> None:
    path = tmp_path / "verdict.json"
    assert write_whole(path, lambda partial: partial.write_text("{}"), "not_kept")
    assert [p.name for p in tmp_path.iterdir()] == ["verdict.json"] and path.read_text() == "{}"


def test_a_failed_write_leaves_the_old_file_and_no_partial(tmp_path: Path) -> None:
    path = tmp_path / "verdict.json"
    path.write_text("old")

    def half(partial: Path) -> None:
        partial.write_text("ha")
        raise OSError("disk full")

    with capture_logs() as logs:
        assert not write_whole(path, half, "not_kept")
    assert [p.name for p in tmp_path.iterdir()] == ["verdict.json"] and path.read_text() == "old"
    assert [(e["event"], e["reason"]) for e in logs] == [("not_kept", "OSError('disk full')")]


def test_a_directory_that_is_a_file_is_a_warning_not_an_error(tmp_path: Path) -> None:
    (tmp_path / "cache").write_text("")
    path = tmp_path / "cache" / "verdict.json"
    with capture_logs() as logs:
        assert not write_whole(path, lambda partial: partial.write_text("{}"), "not_kept")
    assert [e["event"] for e in logs] == ["not_kept"] and "NotADirectoryError" in logs[0]["reason"]
