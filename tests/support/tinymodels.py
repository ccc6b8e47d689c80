"""Tiny random-weight models built offline, for tests that need a real transformers model directory of a given
shape (a family, a tokenizer that adds a BOS, no chat template) without downloading one.

Each family has a builder that writes a model and its tokenizer into a directory with ``save_pretrained``, so that
``Settings(model=<dir>)`` loads it as it would any local model. The weights are random (seeded): the text a model
writes is noise, but the tokens, the prompt lengths and every code path around them are real.

Use :func:`build` (a directory per family, built once and reused when its ``config.json`` is there); the tests'
``tiny_models`` fixture keeps one directory per test session.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

BOS, EOS, UNK = "<s>", "</s>", "<unk>"
# Whole words only (a WordLevel model over whitespace-split words): what the tests write must be made of these,
# or it reads as <unk>. The three specials come first, so that their ids are 0, 1 and 2.
_PLAIN_WORDS = (
    "hello world the a an is of and to in it you what how why who capital france paris tell me story about dragon "
    "fly write long short answer question please say hi one two three system user assistant . , ? ! : ; ' \""
)
WORDS = (BOS, EOS, UNK, *_PLAIN_WORDS.split())
SEED = 0


def tokenizer_without_template() -> Any:
    """A fast tokenizer that adds ``<s>`` in front of every text by default and has no chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # "<s> $A": tokenizer(text) adds the BOS, tokenizer(text, add_special_tokens=False) does not.
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=BOS, eos_token=EOS, unk_token=UNK)
    tokenizer.model_max_length = 256
    return tokenizer


def llama(directory: Path) -> None:
    """A 2-layer Llama (64 wide, grouped KV heads) with :func:`tokenizer_without_template`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = tokenizer_without_template()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(str(directory), safe_serialization=True)
    tokenizer.save_pretrained(str(directory))


BUILDERS: dict[str, Callable[[Path], None]] = {"llama": llama}
"""Family → builder; a builder writes a loadable model directory (weights, config, tokenizer) into its argument."""


def build(family: str, root: Path) -> Path:
    """The directory of ``family``'s tiny model under ``root``, built there unless it is there already."""
    try:
        builder = BUILDERS[family]
    except KeyError:
        raise ValueError(f"no tiny model of family {family!r}; known: {', '.join(sorted(BUILDERS))}") from None
    directory = root / f"tiny-{family}"
    if not (directory / "config.json").is_file():
        directory.mkdir(parents=True, exist_ok=True)
        builder(directory)
        tokenizer = _load_tokenizer(directory)
        # What the tests built this model for: a BOS added by default, no chat template.
        assert tokenizer("hello world")["input_ids"][0] == tokenizer.bos_token_id, "the tokenizer adds no BOS"
        assert tokenizer.chat_template is None, "the tokenizer has a chat template"
    return directory


def _load_tokenizer(directory: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


# GGUF families: a random-weight model of each, written as a user's GGUF is (llama.cpp's tensor names and metadata,
# convert_hf_to_gguf.py's), its linear layers quantised, so that it loads through the path a user's file takes.
_CHARACTERS = tuple("\u2581abcdefghijklmnopqrstuvwxyz.,?!:;'\"")
GGUF_TOKENS = ("<unk>", "<s>", "</s>", *_CHARACTERS)
"""The GGUF models' vocabulary (a sentencepiece one, ``tokenizer.ggml.model`` "llama"): the specials, then one token
a character, so that every lower-case text tokenizes (a character a token) and a BOS comes first."""


def _family_config(family: str, hidden: int, layers: int) -> Any:
    from transformers import Gemma3TextConfig, NemotronConfig, Qwen2Config, Qwen3Config

    shared = {
        "vocab_size": len(GGUF_TOKENS),
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "max_position_embeddings": 512,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": None,
        "tie_word_embeddings": False,
    }
    if family == "qwen2":
        return Qwen2Config(num_attention_heads=4, num_key_value_heads=2, rope_theta=1e6, **shared)
    if family == "qwen3":
        # transformers reads no head_dim from a Qwen3 GGUF: the config's default (128) is what it loads.
        return Qwen3Config(num_attention_heads=4, num_key_value_heads=2, head_dim=128, rope_theta=1e6, **shared)
    if family == "gemma3":
        # A Gemma 3 GGUF carries neither the layer pattern nor the local rotary base nor query_pre_attn_scalar:
        # the loader takes the defaults (every 6th layer full, 10000, 256), so these are the same.
        return Gemma3TextConfig(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            sliding_window=GEMMA3_WINDOW,
            rope_theta=1e6,
            **shared,
        )
    if family == "nemotron":  # a family the engine has no fused layer for
        return NemotronConfig(num_attention_heads=4, num_key_value_heads=2, rope_theta=1e6, **shared)
    raise ValueError(f"no GGUF family {family!r}; known: {', '.join(GGUF_FAMILIES)}")


GGUF_FAMILIES = ("qwen2", "qwen3", "gemma3", "nemotron")
GEMMA3_WINDOW = 8
"""The tiny Gemma 3's sliding window, in tokens: shorter than the tests' prompts (a character a token)."""
_ARCHITECTURES = {"qwen2": "QWEN2", "qwen3": "QWEN3", "gemma3": "GEMMA3", "nemotron": "NEMOTRON"}


def gguf_model(family: str, path: Path, *, hidden: int = 64, layers: int = 0, kind: str = "Q8_0") -> None:
    """A random-weight ``family`` model (:data:`GGUF_FAMILIES`) written as a GGUF at ``path``: its decoder layers'
    linear layers quantised as ``kind`` (``Q4_K_M``: llama.cpp's mix, Q4_K with ``attn_v`` and ``ffn_down`` in
    Q6_K; a K-quant needs ``hidden`` a multiple of 256), everything else fp32; every bias and norm weight random
    (none is what the library initialises it to, so each changes the output). ``layers`` 0: 2 (6 for Gemma 3, one
    full and five sliding-window layers)."""
    import gguf
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from tests.support.ggufs import quantise, write_model_gguf

    layers = layers or (6 if family == "gemma3" else 2)
    config = _family_config(family, hidden, layers)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                parameter.copy_(torch.randn_like(parameter) * 0.5 + (1.0 if family in ("qwen2", "qwen3") else 0.0))
        # The specials' logits exactly 0, below the best of the others': a greedy answer runs to its length.
        model.lm_head.weight[:3] = 0.0
    architecture = gguf.MODEL_ARCH[_ARCHITECTURES[family]]
    names = gguf.get_tensor_name_map(architecture, layers)
    tensors: dict[str, tuple[np.ndarray, str]] = {}
    for name, parameter in model.state_dict().items():
        base, suffix = name.rsplit(".", 1)
        target = names.get_name(base)
        assert target is not None, f"no GGUF name for {name}"
        data = parameter.detach().float().numpy()
        if family in ("gemma3", "nemotron") and name.endswith("norm.weight"):
            data = data + np.float32(1.0)  # the GGUF stores 1 + w (convert_hf_to_gguf.py), the loader takes 1 off
        if data.ndim == 2 and ".layers." in name:
            stored = kind
            if kind == "Q4_K_M":
                stored = "Q6_K" if target.endswith(("attn_v", "ffn_down")) else "Q4_K"
            tensors[f"{target}.{suffix}"] = (quantise(data, stored)[0], stored)
        else:
            tensors[f"{target}.{suffix}"] = (data, "F32")
    metadata: dict[str, Any] = {
        "context_length": config.max_position_embeddings,
        "embedding_length": hidden,
        "block_count": layers,
        "feed_forward_length": config.intermediate_size,
        "attention.head_count": config.num_attention_heads,
        "attention.head_count_kv": config.num_key_value_heads,
        "attention.layer_norm_rms_epsilon": float(getattr(config, "rms_norm_eps", 1e-5)),
        "rope.freq_base": 1e6,
    }
    if family == "gemma3":
        metadata |= {
            "attention.key_length": 32,
            "attention.value_length": 32,
            "attention.sliding_window": GEMMA3_WINDOW,
        }
    write_model_gguf(path, architecture, metadata, GGUF_TOKENS, tensors)


def build_gguf(family: str, root: Path, **sizes: Any) -> Path:
    """The GGUF of ``family``'s tiny model (:func:`gguf_model`, of ``sizes``) under ``root``, written there unless
    it is there already."""
    suffix = "".join(f"-{key}{value}" for key, value in sorted(sizes.items()))
    path = root / f"tiny-{family}{suffix}.gguf"
    if not path.is_file():
        root.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        gguf_model(family, partial, **sizes)
        partial.rename(path)
    return path
