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
