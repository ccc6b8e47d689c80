"""transformers' table of its model modules, read from the cache directory at a cold start instead of from the
sources of some 480 model folders.

At its first import of ``transformers.models``, transformers (5.25) builds that table (which module of which model
folder defines which name, and what each needs) with ``transformers.utils.import_utils.define_import_structure``,
which opens and scans every module file under the folder: 0.2-0.4 s of every start, and the same table every time for
one installed copy. :func:`remembered_models_table` wraps that function for that one import: the first start writes
its answer (JSON) to the cache directory, later starts read it back. The file is named by the installed version and a
digest of the folder's listing with each entry's modification time, so another version, or a model folder added or
replaced, builds the table again. Only ``transformers.models``' own table is read from the file; every other call
goes to the function as it is, and it is put back when the import ends.

Where the function is not there (another transformers), or ``transformers.models`` is imported already, the import
runs untouched; a file that cannot be read or written is built again, or not kept (the log says so). The table
gives the same lazy module as the scan: a test compares them. The wrapper answers every caller as the function
does, so a thread that imported a transformers module meanwhile would get the library's answer too.

Gain, kept for it: 0.26 s of every start (the scan 257-275 ms, the file read 5-6 ms; 5 cold processes on 2 shared
Zen 4 cores, transformers 5.25), of a start to ready of about 4 s.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import structlog

from ttft_sse.engine.cache_files import write_whole

log = structlog.get_logger("ttft_sse.engine")

FOLDER = "transformers-models"
"""Where in the cache directory the tables are kept, one file a version and listing."""

Table = dict[frozenset[str], dict[str, set[str]]]
"""define_import_structure's answer: the backends a set of modules needs → each module → the names it defines."""


@contextmanager
def remembered_models_table(cache_dir: Path) -> Iterator[None]:
    """Within the block, the first import of ``transformers.models`` takes its table from ``cache_dir`` (writing it
    there the first time). ``transformers`` itself must be imported already."""
    import transformers
    from transformers.utils import import_utils

    build = getattr(import_utils, "define_import_structure", None)
    models = Path(transformers.__file__).parent / "models"
    if "transformers.models" in sys.modules or not callable(build) or (listed := _listing_digest(models)) is None:
        yield
        return
    init = models / "__init__.py"
    path = cache_dir / FOLDER / f"{transformers.__version__}-{listed}.json"

    def remembered(module_path: str, prefix: str | None = None) -> Table:
        if Path(module_path) != init or prefix is not None:
            return build(module_path, prefix)  # type: ignore[no-any-return]
        table = read(path)
        if table is None:
            table = build(module_path)
            write_whole(path, lambda partial: _write(partial, encode(table)), "models_table_not_kept")
        return table

    import_utils.define_import_structure = remembered
    try:
        yield
    finally:
        import_utils.define_import_structure = build


def read(path: Path) -> Table | None:
    """The table kept at ``path``, or None where there is none or it is not one."""
    try:
        return decode(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("models_table_unreadable", path=str(path), reason=repr(exc))
        return None


def encode(table: Table) -> list[Any]:
    """``table`` as JSON values: ``[[backends…], {module: [names…]}]`` pairs, sorted."""
    pairs = [
        [sorted(needs), {module: sorted(names) for module, names in modules.items()}]
        for needs, modules in table.items()
    ]
    return sorted(pairs, key=lambda pair: pair[0])


def decode(doc: Any) -> Table:
    """:func:`encode`'s inverse; ValueError where ``doc`` is not a table of at least one module."""
    if not isinstance(doc, list) or not doc:
        raise ValueError("not a list of pairs")
    table: Table = {}
    for pair in doc:
        match pair:
            case [list(needs), dict(modules)] if all(isinstance(n, str) for n in needs) and all(
                isinstance(names, list) and all(isinstance(n, str) for n in names) for names in modules.values()
            ):
                table[frozenset(needs)] = {module: set(names) for module, names in modules.items()}
            case _:
                raise ValueError(f"not a pair of backends and modules: {pair!r:.80}")
    return table


def _write(path: Path, doc: list[Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))


def _listing_digest(folder: Path) -> str | None:
    """A digest of ``folder``'s entries and their modification times (a few milliseconds for ~500 entries); None
    where it cannot be listed."""
    digest = hashlib.sha256()
    try:
        with os.scandir(folder) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                digest.update(f"{entry.name}\0{entry.stat().st_mtime_ns}\n".encode())
    except OSError:
        return None
    return digest.hexdigest()[:16]
