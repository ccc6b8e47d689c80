"""The decoder-layer families decoder.c computes, each described by its parts (engine/library/decoder.py fuses them).

Every family is a Llama decoder layer (an RMS norm, q/k/v, the rotary embedding, attention, o, a residual sum, an RMS
norm, a gated MLP, a residual sum) with some of these parts added:

=========== ================= =============== =============================== ==========
family      q/k/v biases      head norms      norms of the o and MLP outputs  gate
=========== ================= =============== =============================== ==========
Llama       no                no              no                              SiLU
Mistral     no                no              no                              SiLU
Qwen 2      yes               no              no                              SiLU
Qwen 3      no                yes             no                              SiLU
Gemma 3     no                yes             yes                             GELU-tanh
=========== ================= =============== =============================== ==========

(SmolLM's layers are transformers' ``LlamaDecoderLayer``; Mistral's are a copy of it, and a Mistral GGUF loads as
Llama.) Gemma's RMS norm multiplies
by ``1 + w``: decoder.c is handed that sum, computed as Gemma's norm computes it (fp32), so the same factor. Its
scaled embeddings are the model's, outside the layers; its attention scale (``query_pre_attn_scalar``) and sliding
windows are the attention module's, which the fused layer calls (or, in one C call, reads: ``scaling``).

A layer of any other class, or of a listed class with parts unlike its family's (a bias where none is expected, an
activation of another kind), is not fused; :func:`why_not` says why, for the log and ``/readyz``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from ttft_sse.engine.kernels import kernel
from ttft_sse.engine.kernels.structs import LINEARS
from ttft_sse.engine.library import internals


@dataclass(frozen=True)
class Family:
    """A decoder layer class decoder.c computes, and which of decoder.c's extra parts it has."""

    name: str
    module: str  # transformers' modeling module
    layer: str  # its decoder layer class
    norm: str  # its RMS norm class
    pre_mlp_norm: str  # the attribute of the norm before the MLP
    biases: bool = False  # q, k and v have biases (Qwen 2)
    head_norms: bool = False  # q_norm and k_norm over each head, before the rotary embedding (Qwen 3, Gemma 3)
    output_norms: tuple[str, str] | None = None  # the norms of the o and MLP outputs (Gemma 3)
    gelu: bool = False  # GELU-tanh gate, not SiLU (Gemma 3)
    offset: float = 0.0  # the norms multiply by offset + w (Gemma: 1)

    def classes(self) -> tuple[type[Any], type[Any]]:
        """The decoder layer and RMS norm classes (ImportError or AttributeError where transformers has none)."""
        layer, norm = internals.modeling(self.module, self.layer, self.norm)
        return layer, norm


_T = "transformers.models"
FAMILIES = (
    Family("llama", f"{_T}.llama.modeling_llama", "LlamaDecoderLayer", "LlamaRMSNorm", "post_attention_layernorm"),
    Family(
        "mistral", f"{_T}.mistral.modeling_mistral", "MistralDecoderLayer", "MistralRMSNorm",
        "post_attention_layernorm",
    ),
    Family(
        "qwen2", f"{_T}.qwen2.modeling_qwen2", "Qwen2DecoderLayer", "Qwen2RMSNorm", "post_attention_layernorm",
        biases=True,
    ),
    Family(
        "qwen3", f"{_T}.qwen3.modeling_qwen3", "Qwen3DecoderLayer", "Qwen3RMSNorm", "post_attention_layernorm",
        head_norms=True,
    ),
    Family(
        "gemma3", f"{_T}.gemma3.modeling_gemma3", "Gemma3DecoderLayer", "Gemma3RMSNorm", "pre_feedforward_layernorm",
        head_norms=True, output_norms=("post_attention_layernorm", "post_feedforward_layernorm"), gelu=True,
        offset=1.0,
    ),
)  # fmt: skip
"""The families decoder.c computes."""


def family_of(layer: Any) -> Family | None:
    """The family whose decoder layer class ``layer`` is (exactly), or None."""
    for family in FAMILIES:
        try:
            kind = family.classes()[0]
        except (ImportError, AttributeError):  # a transformers without this family
            continue
        if type(layer) is kind:
            return family
    return None


def decoder_layers(model: Any) -> list[Any]:
    """``model``'s decoder layers: its base model's ``layers`` where it has them, else every module whose class
    name ends in ``DecoderLayer``."""
    layers = getattr(getattr(model, "base_model", None), "layers", None)
    if layers is not None:
        return list(layers)
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


def norms(layer: Any, family: Family) -> list[Any]:
    """``layer``'s RMS norm modules decoder.c reads, in the order of ``struct layer``'s pointers: input, pre-MLP,
    then q and k's (head norms), then the o and MLP outputs'."""
    found = [layer.input_layernorm, getattr(layer, family.pre_mlp_norm)]
    if family.head_norms:
        found += [layer.self_attn.q_norm, layer.self_attn.k_norm]
    if family.output_norms is not None:
        found += [getattr(layer, name) for name in family.output_norms]
    return found


def epsilon(norm: Any) -> float:
    """An RMS norm module's epsilon (Llama's and Qwen's ``variance_epsilon``, Gemma's ``eps``)."""
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", -1.0)))


def why_not(layer: Any, family: Family | None, torch: Any) -> str | None:
    """Why decoder.c cannot compute ``layer`` (a sentence naming its class), or None where it can: its linear layers
    on the block kernel, with biases on q, k and v exactly where its family has them, its family's RMS norms in
    fp32 with one epsilon, its family's activation, heads of at most 256 (even) values."""
    name = type(layer).__name__
    if family is None:
        return f"{name}: no fused form"
    from transformers.activations import GELUTanh, SiLUActivation

    block = kernel.block_linear_class()
    linears = {part: layer.get_submodule(path) for part, path in LINEARS.items()}
    if not all(type(m) is block and m.activations in ("fp32", "int8") for m in linears.values()):
        return f"{name}: not every linear layer is on the block kernel"
    biased = {part for part, m in linears.items() if m.bias is not None}
    if biased != ({"q", "k", "v"} if family.biases else set()):
        return f"{name}: biases on {sorted(biased) or 'none'} of its linear layers, unlike {family.name}'s"
    norm_class = family.classes()[1]
    found = norms(layer, family)
    if not all(type(n) is norm_class and n.weight.dtype == torch.float32 for n in found):
        return f"{name}: its norms are not {family.norm} in fp32"
    if len({epsilon(n) for n in found}) != 1:
        return f"{name}: its norms have different epsilons"
    activation = (GELUTanh,) if family.gelu else (torch.nn.SiLU, SiLUActivation)
    if type(layer.mlp.act_fn) not in activation:
        return f"{name}: its activation is {type(layer.mlp.act_fn).__name__}"
    dim = layer.self_attn.head_dim
    if dim % 2 or dim > 256:
        return f"{name}: heads of {dim} values"
    return None


def norm_weights(layer: Any, family: Family, torch: Any) -> list[Any]:
    """The weights decoder.c multiplies by for each of :func:`norms`: ``offset + w`` in fp32, as the family's norm
    computes it (Gemma: ``1.0 + w``), contiguous; the parameters themselves where the offset is 0."""
    weights = [n.weight.data for n in norms(layer, family)]
    if family.offset:
        weights = [family.offset + w.float() for w in weights]
    return [w.contiguous() for w in weights]


def rotary(model: Any, layer: Any, rows: Any, positions: Any) -> Any:
    """The rotary embedding ``model`` hands ``layer`` for ``rows`` at ``positions`` (Gemma 3: its layer type's)."""
    return _of_kind(model.base_model.rotary_emb, getattr(layer.self_attn, "layer_type", None), rows, positions)


def _of_kind(embedding: Any, kind: str | None, rows: Any, positions: Any) -> Any:
    """``embedding``'s rotary embedding for ``rows`` at ``positions``: of the layer type ``kind`` where it makes
    one for each (Gemma 3's), else its only one."""
    if kind and getattr(embedding, "layer_types", None):
        return embedding(rows, positions, kind)
    return embedding(rows, position_ids=positions)


def rotary_kinds(model: Any, layers: list[Any]) -> tuple[tuple[str, ...], Any]:
    """Where ``layers`` take rotary embeddings of several kinds (Gemma 3's sliding and full layers: other bases),
    each layer's kind and the model's rotary embedding that makes them; else ``()`` and None (one for all)."""
    kinds = tuple(getattr(m.self_attn, "layer_type", "") for m in layers)
    embedding = getattr(model.base_model, "rotary_emb", None)
    if len(set(kinds)) > 1 and getattr(embedding, "layer_types", None):
        return kinds, embedding
    return (), None


def embeddings(
    embedding: Any, kinds: tuple[str, ...], x: Any, cos: Any, sin: Any, positions: Any
) -> dict[str, tuple[Any, Any]]:
    """The rotary embedding (cos, sin) of each of ``kinds`` for rows ``x`` at ``positions``, in the shape of ``cos``:
    the first kind's is ``cos`` and ``sin``, each other made by ``embedding`` as the model makes it for its
    layers."""
    if positions is None:
        raise ValueError("the layers take rotary embeddings of several kinds: their positions are needed")
    made = {kinds[0]: (cos, sin)}
    for kind in dict.fromkeys(kinds):
        if kind not in made:
            c, s = _of_kind(embedding, kind, x, positions)
            made[kind] = (c.expand(cos.shape).contiguous(), s.expand(sin.shape).contiguous())
    return made


class FusedLayer:
    """What every fused decoder layer class is (engine/library/decoder.py's ``fused_layer_class``)."""


_reasons: weakref.WeakKeyDictionary[Any, str | None] = weakref.WeakKeyDictionary()
"""Why decoder.py's ``fuse`` left a model's layers (or some of them) the library's; None where it fused them all."""


def remember(model: Any, reason: str | None) -> None:
    """Keep why ``model``'s layers (or some of them) are not fused, for :func:`label`; None: all are."""
    _reasons[model] = reason


def label(model: Any, *, tried: str | None = None) -> str:
    """What ``/readyz`` says of ``model``'s decoder layers: ``"fused: 24 of 24 layers"``, or ``"not fused (<why>);
    each layer runs in transformers' Python"`` (several times slower a token; docs/engine.md). ``tried``: why
    decoder.py's ``fuse`` was not called, where it was not."""
    layers = decoder_layers(model)
    fused = sum(isinstance(m, FusedLayer) for m in layers)
    reason = tried if tried is not None else _reasons.get(model) or "not tried"
    if fused:
        rest = f"; the others run in transformers' Python ({reason})" if fused < len(layers) else ""
        return f"fused: {fused} of {len(layers)} layers{rest}"
    return f"not fused ({reason}); each layer runs in transformers' Python"
