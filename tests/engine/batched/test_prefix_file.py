"""The prefix store's file (engine/batched/prefix_file.py): what is written is read back, and a file that is missing,
truncated, changed or another server's is refused with the reason, never half read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ttft_sse.engine import kv_file
from ttft_sse.engine.batched import prefix_file
from ttft_sse.engine.batched.prefix_file import Prefix, Stored, Unusable

KEY = {"model": "abc123", "engine": "batched", "kv_dtype": "float32", "block_tokens": 4}


def stored() -> Stored:
    rows = torch.arange(3 * 32, dtype=torch.int64).to(torch.uint8).reshape(3, 32)
    prefixes = (
        Prefix((1, 2, 3, 4, 5, 6, 7, 8), None, "normal", (0, 1)),
        Prefix((1, 2, 3, 4, 9, 9, 9, 9), 12345678901234567890, "normal", (0, 2)),
    )
    return Stored(KEY, prefixes, {"full_attention": rows})


def test_what_is_written_is_read_back_whole(tmp_path: Path) -> None:
    path = tmp_path / "prefixes" / "model.safetensors"
    assert prefix_file.write(path, stored())
    read = prefix_file.read(path, KEY)
    assert isinstance(read, Stored)
    assert read.prefixes == stored().prefixes
    assert torch.equal(read.blocks["full_attention"], stored().blocks["full_attention"])
    assert read.bytes == 96
    assert not list(path.parent.glob(".*partial*"))  # the partial file replaced the path


def test_a_missing_file_is_refused_as_missing(tmp_path: Path) -> None:
    read = prefix_file.read(tmp_path / "none.safetensors", KEY)
    assert isinstance(read, Unusable) and read.what == "missing"


def test_a_truncated_file_is_refused_as_unreadable(tmp_path: Path) -> None:
    path = tmp_path / "p.safetensors"
    prefix_file.write(path, stored())
    path.write_bytes(path.read_bytes()[:-7])
    read = prefix_file.read(path, KEY)
    assert isinstance(read, Unusable) and read.what == "unreadable"
    assert "cannot be read as a safetensors file" in read.reason


def test_a_changed_byte_of_a_block_is_refused_by_the_checksum(tmp_path: Path) -> None:
    path = tmp_path / "p.safetensors"
    prefix_file.write(path, stored())
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # inside the last block's bytes
    path.write_bytes(bytes(data))
    read = prefix_file.read(path, KEY)
    assert isinstance(read, Unusable) and read.what == "corrupt"
    assert "sha256" in read.reason


def test_a_changed_header_is_refused_by_the_checksum(tmp_path: Path) -> None:
    """A header rewritten without its checksum (a token id changed): the checksum covers the prefixes too."""
    path = tmp_path / "p.safetensors"
    prefix_file.write(path, stored())
    header = prefix_file.read(path, KEY)
    assert isinstance(header, Stored)
    import safetensors

    with safetensors.safe_open(str(path), "pt") as opened:
        meta = json.loads(opened.metadata()[kv_file.METADATA])
        tensors = {name: opened.get_tensor(name) for name in opened.keys()}  # noqa: SIM118
    meta["prefixes"][0]["tokens"][0] = 99
    save_file(tensors, str(path), metadata={kv_file.METADATA: json.dumps(meta)})
    read = prefix_file.read(path, KEY)
    assert isinstance(read, Unusable) and read.what == "corrupt"


@pytest.mark.parametrize("field", ["model", "engine", "kv_dtype", "block_tokens"])
def test_another_servers_file_is_refused_as_foreign_naming_what_differs(tmp_path: Path, field: str) -> None:
    path = tmp_path / "p.safetensors"
    prefix_file.write(path, stored())
    ours = {**KEY, field: "something else"}
    read = prefix_file.read(path, ours)
    assert isinstance(read, Unusable) and read.what == "foreign"
    assert f"its {field} is {KEY[field]!r}, this server's 'something else'" in read.reason


def test_a_file_of_another_kind_is_refused_as_unreadable(tmp_path: Path) -> None:
    path = tmp_path / "p.safetensors"
    path.write_bytes(b"not a safetensors file at all")
    read = prefix_file.read(path, KEY)
    assert isinstance(read, Unusable) and read.what == "unreadable"
    save_file({"x": torch.zeros(2)}, str(path))  # a safetensors file, but none of ours
    read = prefix_file.read(path, KEY)
    assert isinstance(read, Unusable) and read.what == "unreadable" and "header" in read.reason


def test_rows_that_point_past_the_blocks_are_refused_even_with_a_good_checksum(tmp_path: Path) -> None:
    bad = Stored(KEY, (Prefix((1, 2, 3, 4), None, "normal", (5,)),), stored().blocks)
    path = tmp_path / "p.safetensors"
    prefix_file.write(path, bad)
    read = prefix_file.read(path, KEY)
    assert isinstance(read, Unusable) and read.what == "corrupt" and "rows" in read.reason


def test_a_directory_that_cannot_be_written_is_not_an_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert not prefix_file.write(blocker / "p.safetensors", stored())  # its parent is a file
