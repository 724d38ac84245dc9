"""Tiny random-weight models that vLLM serves, built locally (no model hub).

A model folder holds a byte-level BPE tokenizer trained here on a fixed word list
(``tokenizer.json`` + ``tokenizer_config.json``), a ``config.json`` (a small
``LlamaForCausalLM`` or ``DeepseekV3ForCausalLM`` with MLA) and ``model.safetensors``
with seeded random weights.

Why not ``--load-format dummy``: vLLM's dummy weights are uniform in +-1e-3, which makes
attention uniform and the next token a function of the last token alone (10 different
prompts ending in the same words give the same 16 tokens). Such a model cannot tell a
right KV cache from a wrong one. The weights here are drawn with a fan-in scale (and
larger query/key and output gains), so attention is peaked, the output depends on the
whole prompt and the greedy choice has clear margins; :func:`make_prompts` gives prompts
that differ all along their length. The same ``seed`` gives the same bytes everywhere.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal, TypeAlias

import numpy as np

ModelKind: TypeAlias = Literal["llama", "deepseek"]
MODEL_KINDS: Final[tuple[ModelKind, ...]] = ("llama", "deepseek")

#: The tokenizer's training text and the prompts' vocabulary.
WORDS: Final = tuple(
    " ".join(
        (
            "the quick brown fox jumps over a lazy dog while prefill and decode servers",
            "move layers of cache between hosts every request reads its blocks once each",
            "layer is ready green river stone cloud paper lamp window garden silver morning",
            "winter number seven twelve ninety market street music letter yellow engine",
            "signal bridge valley forest orange ladder pocket candle mirror thunder",
        )
    ).split()
)

_COMMON: Final[Mapping[str, Any]] = {
    "max_position_embeddings": 16384,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "float32",
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
}

LLAMA_CONFIG: Final[Mapping[str, Any]] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,  # head_dim 32: the CPU attention backend's smallest
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    **_COMMON,
}

DEEPSEEK_CONFIG: Final[Mapping[str, Any]] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "kv_lora_rank": 512,  # the cache holds 512 latent + 64 rope values per token
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "rms_norm_eps": 1e-6,
    **_COMMON,
}

#: Extra ``vllm serve`` arguments per kind. DeepSeek on CPU: the compiled rotary op of
#: the CPU build is wrong for multi-head MLA queries, so the native one is forced.
SERVER_ARGS: Final[Mapping[ModelKind, tuple[str, ...]]] = {
    "llama": (),
    "deepseek": ("--compilation-config", '{"custom_ops": ["-rotary_embedding"]}'),
}


@dataclass(frozen=True, slots=True)
class TinyModel:
    """A model folder :func:`build_model` wrote, and how to serve it."""

    path: Path
    kind: ModelKind
    name: str  # the served model name requests use
    architecture: str
    num_layers: int
    vocab_size: int
    seed: int
    kv_bytes_per_token: int  # KV cache bytes one token takes over all layers (float32)

    @property
    def server_args(self) -> tuple[str, ...]:
        """The ``vllm serve`` arguments this model needs besides the common ones."""
        return SERVER_ARGS[self.kind]


def build_tokenizer(path: Path) -> int:
    """Train a byte-level BPE on :data:`WORDS`, save it under ``path``; its vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))]
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "model_max_length": 16384,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1))
    size: int = tok.get_vocab_size()
    return size


class _Weights:
    """Seeded random tensors by name: ``linear(out, in)`` is N(0, (gain/sqrt(in))^2)."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.tensors: dict[str, np.ndarray] = {}

    def linear(self, name: str, rows: int, cols: int, gain: float = 1.0) -> None:
        scale = gain / np.sqrt(cols)
        self.tensors[name] = (self.rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    def norm(self, name: str, size: int) -> None:
        self.tensors[name] = np.ones(size, dtype=np.float32)

    def common(self, cfg: Mapping[str, Any]) -> None:
        vocab, hidden = cfg["vocab_size"], cfg["hidden_size"]
        self.tensors["model.embed_tokens.weight"] = self.rng.standard_normal(
            (vocab, hidden)
        ).astype(np.float32)
        self.norm("model.norm.weight", hidden)
        self.linear("lm_head.weight", vocab, hidden, gain=4.0)  # clear greedy margins

    def mlp(self, prefix: str, hidden: int, inner: int) -> None:
        self.linear(f"{prefix}.gate_proj.weight", inner, hidden)
        self.linear(f"{prefix}.up_proj.weight", inner, hidden)
        self.linear(f"{prefix}.down_proj.weight", hidden, inner)


def llama_weights(cfg: Mapping[str, Any], seed: int) -> dict[str, np.ndarray]:
    """Every tensor vLLM's ``LlamaForCausalLM`` loads, by checkpoint name."""
    w = _Weights(seed)
    w.common(cfg)
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv_heads, head_dim = cfg["num_key_value_heads"], hidden // heads
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        w.norm(f"{p}.input_layernorm.weight", hidden)
        w.norm(f"{p}.post_attention_layernorm.weight", hidden)
        w.linear(f"{p}.self_attn.q_proj.weight", heads * head_dim, hidden, gain=3.0)
        w.linear(f"{p}.self_attn.k_proj.weight", kv_heads * head_dim, hidden, gain=3.0)
        w.linear(f"{p}.self_attn.v_proj.weight", kv_heads * head_dim, hidden)
        w.linear(f"{p}.self_attn.o_proj.weight", hidden, heads * head_dim, gain=2.0)
        w.mlp(f"{p}.mlp", hidden, cfg["intermediate_size"])
    return w.tensors


def deepseek_weights(cfg: Mapping[str, Any], seed: int) -> dict[str, np.ndarray]:
    """Every tensor vLLM's ``DeepseekV3ForCausalLM`` loads (MLA, ``q_lora_rank`` None)."""
    w = _Weights(seed)
    w.common(cfg)
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    nope, rope, v_dim = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    rank, experts = cfg["kv_lora_rank"], cfg["n_routed_experts"]
    moe_inner = cfg["moe_intermediate_size"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        w.norm(f"{p}.input_layernorm.weight", hidden)
        w.norm(f"{p}.post_attention_layernorm.weight", hidden)
        w.linear(f"{p}.self_attn.q_proj.weight", heads * (nope + rope), hidden, gain=3.0)
        w.linear(f"{p}.self_attn.kv_a_proj_with_mqa.weight", rank + rope, hidden, gain=3.0)
        w.norm(f"{p}.self_attn.kv_a_layernorm.weight", rank)
        w.linear(f"{p}.self_attn.kv_b_proj.weight", heads * (nope + v_dim), rank)
        w.linear(f"{p}.self_attn.o_proj.weight", hidden, heads * v_dim, gain=2.0)
        if i < cfg["first_k_dense_replace"]:
            w.mlp(f"{p}.mlp", hidden, cfg["intermediate_size"])
            continue
        w.linear(f"{p}.mlp.gate.weight", experts, hidden)
        w.tensors[f"{p}.mlp.gate.e_score_correction_bias"] = np.zeros(experts, np.float32)
        for e in range(experts):
            w.mlp(f"{p}.mlp.experts.{e}", hidden, moe_inner)
        w.mlp(f"{p}.mlp.shared_experts", hidden, moe_inner * cfg["n_shared_experts"])
    return w.tensors


_BUILDERS: Final[Mapping[ModelKind, tuple[Mapping[str, Any], Callable[..., Any]]]] = {
    "llama": (LLAMA_CONFIG, llama_weights),
    "deepseek": (DEEPSEEK_CONFIG, deepseek_weights),
}


def kv_bytes_per_token(cfg: Mapping[str, Any], dtype_size: int = 4) -> int:
    """Bytes of KV cache per token over all layers: K and V per KV head, or MLA's latent
    plus rope key."""
    if "kv_lora_rank" in cfg:
        per_layer = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    else:
        head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
        per_layer = 2 * cfg["num_key_value_heads"] * head_dim
    return int(per_layer * dtype_size * cfg["num_hidden_layers"])


def build_model(
    path: Path,
    kind: ModelKind = "llama",
    seed: int = 0,
    overrides: Mapping[str, Any] | None = None,
) -> TinyModel:
    """Write a servable tiny model of ``kind`` into ``path`` (created if missing).

    ``overrides`` replaces entries of the kind's config (e.g. ``num_hidden_layers``,
    ``hidden_size``, ``intermediate_size``, ``num_attention_heads``,
    ``num_key_value_heads``) for a larger model; the weights follow the config.
    """
    if kind not in _BUILDERS:
        raise ValueError(f"unknown model kind {kind!r}; choose one of {', '.join(MODEL_KINDS)}")
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    base, make_weights = _BUILDERS[kind]
    cfg = {**base, **(overrides or {}), "vocab_size": build_tokenizer(path)}
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(make_weights(cfg, seed), str(path / "model.safetensors"), {"format": "pt"})
    return TinyModel(
        path=path,
        kind=kind,
        name=f"tiny-{kind}",
        architecture=cfg["architectures"][0],
        num_layers=cfg["num_hidden_layers"],
        vocab_size=cfg["vocab_size"],
        seed=seed,
        kv_bytes_per_token=kv_bytes_per_token(cfg),
    )


def make_prompts(count: int, seed: int = 0, words: tuple[int, int] = (20, 60)) -> list[str]:
    """``count`` distinct prompts of ``words[0]..words[1]`` random words from :data:`WORDS`."""
    rng = random.Random(seed)
    prompts: list[str] = []
    while len(prompts) < count:
        n = rng.randint(*words)
        prompt = " ".join(rng.choice(WORDS) for _ in range(n))
        if prompt not in prompts:
            prompts.append(prompt)
    return prompts
