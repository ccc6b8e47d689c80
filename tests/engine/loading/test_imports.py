"""transformers' table of its model modules kept in the cache directory (engine/loading/imports.py): the first start
writes it, the next reads it and gets the same lazy module as the scan; another listing builds it again; every other
call goes to transformers' own function, which is put back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ttft_sse.engine.loading import imports

# A new process (transformers.models not imported yet) that imports transformers.models with the table from the cache
# directory in argv[1], and prints what it saw as JSON.
START = """
import hashlib, json, sys
from pathlib import Path
import transformers
from transformers.utils import import_utils
from ttft_sse.engine.loading import imports

scanned = []
scan = import_utils.create_import_structure_from_path
def counted(path):
    scanned.append(path)
    return scan(path)
import_utils.create_import_structure_from_path = counted
own = import_utils.define_import_structure
with imports.remembered_models_table(Path(sys.argv[1])):
    import transformers.models  # what load_model's imports import first (through transformers.activations)
models = sys.modules["transformers.models"]
print(json.dumps({
    "scanned_models": sum(str(p).endswith("/transformers/models/__init__.py") for p in scanned),
    "classes": hashlib.sha256(json.dumps(sorted(models._class_to_module.items())).encode()).hexdigest(),
    "classes_count": len(models._class_to_module),
    "llama": models._class_to_module["LlamaForCausalLM"],
    "put_back": import_utils.define_import_structure is own,
}))
"""


def start(cache_dir: Path) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", START, str(cache_dir)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_the_first_start_scans_and_keeps_the_table_and_the_next_reads_it_into_the_same_lazy_module(
    tmp_path: Path,
) -> None:
    first = start(tmp_path)
    kept = list((tmp_path / imports.FOLDER).iterdir())
    second = start(tmp_path)
    assert first["scanned_models"] == 1 and second["scanned_models"] == 0  # read, not scanned
    assert [path.suffix for path in kept] == [".json"] and list((tmp_path / imports.FOLDER).iterdir()) == kept
    assert second["classes"] == first["classes"] and first["classes_count"] > 3000
    assert second["llama"] == first["llama"] == "llama.modeling_llama"
    assert first["put_back"] and second["put_back"]


def test_a_table_kept_for_another_listing_is_not_read(tmp_path: Path) -> None:
    stale = tmp_path / imports.FOLDER / "0.0.0-0000000000000000.json"
    stale.parent.mkdir()
    stale.write_text("[]")  # an empty table: read, it would leave transformers.models without a single class
    assert start(tmp_path)["scanned_models"] == 1


def test_a_file_that_is_not_a_table_is_scanned_again_and_replaced(tmp_path: Path) -> None:
    start(tmp_path)
    (kept,) = (tmp_path / imports.FOLDER).iterdir()
    kept.write_text('{"not": "a table"}')
    assert start(tmp_path)["scanned_models"] == 1
    assert imports.read(kept) is not None


def test_a_cache_directory_that_cannot_be_written_only_costs_the_scan(tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the directory would be: nothing can be made under it
    assert start(blocked)["scanned_models"] == 1  # and it started, its table scanned as without the file


def test_the_table_round_trips_through_json() -> None:
    table = {
        frozenset(): {"llama.modeling_llama": {"LlamaModel", "LlamaForCausalLM"}},
        frozenset({"tokenizers", "torch"}): {"x.y": set()},
    }
    doc = json.loads(json.dumps(imports.encode(table)))
    assert imports.decode(doc) == table
    assert doc[0] == [[], {"llama.modeling_llama": ["LlamaForCausalLM", "LlamaModel"]}]


@pytest.mark.parametrize("doc", ["{}", "[[1, 2]]", "[[[], [1]]]", "not json"])
def test_what_is_not_a_table_reads_as_none(tmp_path: Path, doc: str) -> None:
    path = tmp_path / "table.json"
    path.write_text(doc)
    assert imports.read(path) is None
    assert imports.read(tmp_path / "missing.json") is None
