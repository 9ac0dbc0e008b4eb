"""`tiny-llama`: tiny random llama-family checkpoints for tests on machines without a real model.

HF layout (config.json, model.safetensors in bf16, the tokenizer files copied from a real
model), loadable by mlx_lm.utils.load and by the C++ loader (src/model/llama.cc). Variants:
llama, mistral (llama layout, its own model_type), qwen2 (q/k/v biases), qwen3 (q/k RMSNorm,
explicit head_dim that may differ from hidden/heads).

Every norm weight and bias is random, not ones or zeros, so a program that skips one shows it.
Projections are scaled so top logits are well separated: greedy decoding then does not hinge on
last-bit ties, so native and mounted answers can be compared exactly.
"""

import json
import math
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict

import mlx.core as mx

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
)

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# Embedding scale: larger makes one token win every step with probability 1 (a useless test of
# answers); smaller leaves top-2 logit margins near bf16 noise. 0.2 gives margins around 1.
EMBED_STD = 0.2
# Norm weights are 1 + N(0, NORM_STD) and biases N(0, BIAS_STD): far enough from the trivial
# values that dropping one changes every output, near enough that activations stay tame.
NORM_STD = 0.1
BIAS_STD = 0.1


@dataclass(frozen=True)
class TinyShape:
    """Dimensions of a tiny checkpoint. head_dim defaults to hidden // heads."""

    model_type: str = "llama"
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 0
    intermediate: int = 128
    tie: bool = True
    rope_theta: float = 100000.0
    rms_norm_eps: float = 1e-5
    # The config's rope_scaling as JSON text ("" for none), as real checkpoints carry it (e.g.
    # Llama 3.1's llama3 block); rope_traditional as llama/qwen2 read it; rope_parameters puts
    # rope_theta and the scaling in a transformers-v5 rope_parameters block instead (qwen3).
    rope_scaling: str = ""
    rope_traditional: bool = False
    rope_parameters: bool = False
    max_position_embeddings: int = 32768
    # llama/mistral: > 0 makes the odd layers "sliding_attention" over this many positions (the
    # even ones full), as mlx-lm reads layer_types and sliding_window.
    sliding_window: int = 0

    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def check(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r} is not one of {MODEL_TYPES}")
        if min(self.layers, self.hidden, self.heads, self.kv_heads, self.intermediate) <= 0:
            raise ValueError("layers, hidden, heads, kv_heads and intermediate must be positive")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} is not a multiple of kv_heads {self.kv_heads}")
        if self.resolved_head_dim() % 2:
            raise ValueError(f"head_dim {self.resolved_head_dim()} must be even for RoPE")
        # mlx-lm's load builds the tokenizer through transformers, whose LlamaConfig refuses this.
        if self.model_type == "llama" and self.hidden % self.heads:
            raise ValueError(f"llama needs hidden {self.hidden} to be a multiple of heads")
        # mlx-lm's qwen2 ignores a config head_dim and uses hidden // heads; refuse a config that
        # the decoder and a head_dim-honoring loader would read differently.
        if self.model_type == "qwen2" and self.resolved_head_dim() * self.heads != self.hidden:
            raise ValueError("qwen2 needs head_dim * heads == hidden (mlx-lm derives head_dim)")
        if self.rope_scaling and not isinstance(json.loads(self.rope_scaling), dict):
            raise ValueError("rope_scaling must be a JSON object")
        if self.rope_parameters and self.model_type != "qwen3":
            raise ValueError("only mlx-lm's qwen3 reads a rope_parameters block")


def _config(shape: TinyShape, vocab_size: int) -> Dict:
    config = {
        "architectures": [ARCHITECTURES[shape.model_type]],
        "model_type": shape.model_type,
        "hidden_size": shape.hidden,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.resolved_head_dim(),
        "intermediate_size": shape.intermediate,
        "vocab_size": vocab_size,
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "rope_scaling": json.loads(shape.rope_scaling) if shape.rope_scaling else None,
        "max_position_embeddings": shape.max_position_embeddings,
        "tie_word_embeddings": shape.tie,
        "torch_dtype": "bfloat16",
    }
    if shape.model_type in ("llama", "mistral"):
        config["attention_bias"] = False
        config["mlp_bias"] = False
    if shape.model_type == "mistral":
        config["sliding_window"] = None  # a window would make mlx-lm build rotating caches
    if shape.sliding_window:
        config["sliding_window"] = shape.sliding_window
        config["layer_types"] = ["sliding_attention" if i % 2 else "full_attention"
                                 for i in range(shape.layers)]
    if shape.model_type == "qwen2":
        del config["head_dim"]  # real Qwen2 configs have none; mlx-lm derives it
    if shape.rope_traditional:
        config["rope_traditional"] = True
    if shape.rope_parameters:
        params = {"rope_theta": config.pop("rope_theta"), "rope_type": "default"}
        params.update(config.pop("rope_scaling") or {})
        config["rope_parameters"] = params
    return config


def _linear(out_dim: int, in_dim: int) -> mx.array:
    return mx.random.normal((out_dim, in_dim)) / math.sqrt(in_dim)


def _norm(dim: int) -> mx.array:
    return 1.0 + NORM_STD * mx.random.normal((dim,))


def _weights(shape: TinyShape, vocab_size: int) -> Dict[str, mx.array]:
    h, hd, ffn = shape.hidden, shape.resolved_head_dim(), shape.intermediate
    q, kv = shape.heads * hd, shape.kv_heads * hd
    w = {
        "model.embed_tokens.weight": mx.random.normal((vocab_size, h)) * EMBED_STD,
        "model.norm.weight": _norm(h),
    }
    if not shape.tie:
        w["lm_head.weight"] = _linear(vocab_size, h)
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = _linear(q, h)
        w[p + "self_attn.k_proj.weight"] = _linear(kv, h)
        w[p + "self_attn.v_proj.weight"] = _linear(kv, h)
        w[p + "self_attn.o_proj.weight"] = _linear(h, q)
        if shape.model_type == "qwen2":
            w[p + "self_attn.q_proj.bias"] = BIAS_STD * mx.random.normal((q,))
            w[p + "self_attn.k_proj.bias"] = BIAS_STD * mx.random.normal((kv,))
            w[p + "self_attn.v_proj.bias"] = BIAS_STD * mx.random.normal((kv,))
        if shape.model_type == "qwen3":
            w[p + "self_attn.q_norm.weight"] = _norm(hd)
            w[p + "self_attn.k_norm.weight"] = _norm(hd)
        w[p + "mlp.gate_proj.weight"] = _linear(ffn, h)
        w[p + "mlp.up_proj.weight"] = _linear(ffn, h)
        w[p + "mlp.down_proj.weight"] = _linear(h, ffn)
        w[p + "input_layernorm.weight"] = _norm(h)
        w[p + "post_attention_layernorm.weight"] = _norm(h)
    return {k: v.astype(mx.bfloat16) for k, v in w.items()}


def _vocab_size(tokenizer_dir: Path) -> int:
    from transformers import AutoTokenizer  # only this dev command needs it directly

    return len(AutoTokenizer.from_pretrained(str(tokenizer_dir)))


def make_tiny_llama(
    tokenizer_dir: Path, out: Path, seed: int = 0, shape: TinyShape = TinyShape()
) -> Dict:
    """Writes the checkpoint into `out`; the same seed and shape give the same bytes."""
    shape.check()
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    vocab_size = _vocab_size(tokenizer_dir)
    mx.random.seed(seed)
    weights = _weights(shape, vocab_size)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    config = _config(shape, vocab_size)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {"seed": seed, "vocab_size": vocab_size, **asdict(shape)}
