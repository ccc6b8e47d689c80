"""A model assembled from its GGUF file without expanding the file's weights to fp32.

transformers' own GGUF loading dequantises every tensor of the file to fp32 before the model exists: six bytes a
parameter at its peak for a file of 0.6. Here the model's structure is built with no weights at all (accelerate's
``init_empty_weights``: every parameter on torch's meta device), each weight is found in the file by its name
(transformers' table of GGUF names, the ``gguf`` package's per architecture, :func:`places`), and then

- the linear layers the block kernel runs take their codes from the file (engine/kernels/kernel.py, called by the
  loader between :func:`empty` and :func:`fill`): never in fp32;
- the token embedding stays in the file's type, its rows read as tokens come (engine/loading/embedding.py), on CPU;
- everything else (norms, biases, layers the kernel does not run, every weight on a GPU) is dequantised one tensor at
  a time into the model's dtype (:func:`fill`).

transformers' loader also changes some tensors as it reads them (its ``TensorProcessor`` for the architecture:
Llama's q and k rows put back in the order the model computes them, Gemma's norms less one). Each weight's change is
taken from that same processor: run on the row numbers of a matrix, it gives the order of the model's rows
(:class:`stored.Place`); on a vector, on its values. An architecture whose processor does more (splits or joins
tensors: the MoE and fused-QKV ones) is not assembled here: :func:`places` says why, and the loader lets
transformers load the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from ttft_sse.engine.kernels import kernel
from ttft_sse.engine.kernels import stored as stored_module
from ttft_sse.engine.kernels.stored import Place, Stored
from ttft_sse.engine.loading import embedding

log = structlog.get_logger("ttft_sse.engine")

PROCESSORS = frozenset({"TensorProcessor", "LlamaTensorProcessor", "Gemma2TensorProcessor", "NemotronTensorProcessor"})
"""transformers' tensor processors whose changes :func:`places` reproduces: none, a row order, a change of a
vector's values."""


class NotAssembled(Exception):
    """The file cannot be assembled here (the message says why); transformers loads it instead."""


@dataclass
class Assembly:
    """A model under assembly: the model (its weights on the meta device until filled), the file's tensors by the
    model's parameter names, and transformers' processor for changes of values (vectors)."""

    model: Any
    stored: Stored
    processor: Any
    changes_values: frozenset[str]  # parameters whose values the processor changes (taken from it at fill)


def empty(location: str, torch: Any, transformers: Any, dtype: Any) -> Any:
    """The model of the config at ``location`` with every weight on the meta device (buffers, which the model computes
    itself, are real)."""
    from accelerate import init_empty_weights

    config = transformers.AutoConfig.from_pretrained(location)
    with init_empty_weights(include_buffers=False):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model


class _Names:
    """What transformers' ``get_gguf_hf_weights_map`` reads of a model: its config and its weights' names, and no
    children (it would otherwise build the architecture's name map again for each of its ~400 modules: 2 s a start;
    the top level's names are every weight's)."""

    def __init__(self, model: Any) -> None:
        self.config = model.config
        self._names = dict.fromkeys(model.state_dict())

    def state_dict(self) -> dict[str, None]:
        return self._names

    def named_children(self) -> Any:
        return iter(())


def places(model: Any, gguf: Path, torch: Any, folder: Path | None = None) -> Assembly:
    """Each weight of ``model`` found in the GGUF file at ``gguf`` (the module docstring); raises
    :class:`NotAssembled` where the file's architecture changes tensors in ways not reproduced here, or a weight is
    missing."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    needed = ("TENSOR_PROCESSORS", "TensorProcessor", "get_gguf_hf_weights_map")
    if missing := [name for name in needed if not hasattr(gguf_utils, name)]:
        raise NotAssembled(f"transformers' GGUF module has no {', '.join(missing)}")
    tensors, arch = stored_module.header(gguf, None if folder is None else folder / stored_module.HEADER_FILE)
    processor = gguf_utils.TENSOR_PROCESSORS.get(arch, gguf_utils.TensorProcessor)(config=model.config.to_dict())
    if type(processor).__name__ not in PROCESSORS:
        raise NotAssembled(f"transformers' {type(processor).__name__} for {arch} splits or joins tensors")
    names = gguf_utils.get_gguf_hf_weights_map(_Names(model), processor)  # the file's names to the model's
    by_parameter: dict[str, Place] = {}
    changes_values: set[str] = set()
    for tensor_name, parameter in names.items():
        tensor = tensors.get(tensor_name)
        if tensor is None:
            continue
        if len(tensor.shape) == 1:
            values = np.arange(tensor.shape[0], dtype=np.float64)
            if not np.array_equal(processor.process(weights=values.copy(), name=tensor_name).weights, values):
                changes_values.add(parameter)  # its values, or their order: the processor runs on them at fill
            by_parameter[parameter] = Place(tensor_name)
            continue
        rows = np.arange(tensor.shape[0], dtype=np.float64).reshape(-1, 1)
        moved = np.asarray(processor.process(weights=rows, name=tensor_name).weights)
        if moved.shape != rows.shape or not np.array_equal(np.sort(moved[:, 0]), rows[:, 0]):
            raise NotAssembled(f"transformers changes {tensor_name} in a way other than its rows' order")
        order = moved[:, 0].astype(np.intp)
        identity = bool(np.array_equal(order, np.arange(len(order))))
        by_parameter[parameter] = Place(tensor_name, None if identity else order)
    head = model.get_output_embeddings()
    head_name = next((n for n, m in model.named_modules() if m is head), None)
    embed_name = next((n for n, m in model.named_modules() if m is model.get_input_embeddings()), None)
    tied = getattr(model.config, "tie_word_embeddings", False)
    if head_name is not None and f"{head_name}.weight" not in by_parameter and tied and embed_name is not None:
        by_parameter[f"{head_name}.weight"] = by_parameter[f"{embed_name}.weight"]
    missing_weights = [n for n, _ in model.named_parameters(remove_duplicate=False) if n not in by_parameter]
    if missing_weights:
        shown = ", ".join(missing_weights[:5]) + (
            f" and {len(missing_weights) - 5} more" if len(missing_weights) > 5 else ""
        )
        raise NotAssembled(f"the file holds no tensor for {shown}")
    return Assembly(model, Stored(gguf, by_parameter, tensors), processor, frozenset(changes_values))


def fill_vectors(assembly: Assembly, torch: Any, dtype: Any, device: str) -> int:
    """The model's vectors (norms, biases) read from the file: before the block kernel takes the linear layers,
    whose probe adds their biases. Returns the bytes read."""
    read = 0
    for module_name, module in assembly.model.named_modules():
        for short, parameter in list(module.named_parameters(recurse=False)):
            if parameter.is_meta and parameter.dim() < 2:
                name = f"{module_name}.{short}" if module_name else short
                value = _read(assembly, name, tuple(parameter.shape), torch, dtype, device)
                setattr(module, short, value)
                read += value.numel() * value.element_size()
    return read


def fill(assembly: Assembly, torch: Any, dtype: Any, device: str, *, rows_from_file: bool) -> int:
    """Every weight of the model still on the meta device read from the file into ``dtype`` on ``device``, one tensor
    at a time; the token embedding's rows read from the file as tokens come where ``rows_from_file`` (on CPU in fp32:
    engine/loading/embedding.py) and its module allows. Returns the bytes of weights read into memory."""
    model, stored = assembly.model, assembly.stored
    read = 0
    embed = model.get_input_embeddings()
    embed_weight = next(n for n, m in model.named_modules() if m is embed) + ".weight"
    tensor = stored.tensor(embed_weight)
    in_order = stored.places.get(embed_weight, Place("")).order is None
    if (
        rows_from_file
        and tensor is not None
        and in_order
        and embedding.supported(embed, torch)
        and embed.weight.is_meta
    ):
        rows, tensor = stored.mapped(embed_weight)
        embedding.from_file(embed, rows, tensor, torch)
    filled: dict[int, Any] = {}  # a meta parameter several modules share (a tied head's) is read once
    for module_name, module in model.named_modules():
        for short, parameter in list(module.named_parameters(recurse=False)):
            if not parameter.is_meta:
                continue
            if not _reads_weight(module):  # a BlockLinear head tied to an embedding: it reads its own codes
                setattr(module, short, torch.nn.Parameter(torch.empty(0), requires_grad=False))
                continue
            if id(parameter) not in filled:
                name = f"{module_name}.{short}" if module_name else short
                filled[id(parameter)] = _read(assembly, name, tuple(parameter.shape), torch, dtype, device)
                read += filled[id(parameter)].numel() * filled[id(parameter)].element_size()
            setattr(module, short, filled[id(parameter)])
    return read


def _read(assembly: Assembly, name: str, shape: tuple[int, ...], torch: Any, dtype: Any, device: str) -> Any:
    """The parameter ``name`` of ``shape`` read from the file into ``dtype`` on ``device``."""
    stored = assembly.stored
    values = stored.dense(name)
    if name in assembly.changes_values:
        values = np.asarray(assembly.processor.process(weights=values, name=stored.places[name].tensor).weights)
    if tuple(values.shape) != shape:
        raise NotAssembled(f"{name} is {tuple(values.shape)} in the file, {shape} in the model")
    value = torch.from_numpy(np.ascontiguousarray(values, np.float32)).to(device=device, dtype=dtype)
    return torch.nn.Parameter(value, requires_grad=False)


def _reads_weight(module: Any) -> bool:
    """Whether ``module``'s forward reads its ``weight`` (not a ``BlockLinear``, nor an embedding reading the file)."""
    return not isinstance(module, kernel.block_linear_class()) and not hasattr(module, "stored_rows")
