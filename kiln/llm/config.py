"""The shape of a Llama-architecture decoder, read from HF ``config.json`` or GGUF metadata."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kiln.errors import ModelLoadError

LLAMA_LIKE = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position: int = 4096
    tie_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "model"
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"{self.name}: {self.num_heads} attention heads do not divide "
                                 f"into {self.num_kv_heads} KV heads")

    @classmethod
    def from_hf(cls, cfg: dict, name: str = "model") -> ModelConfig:
        arch = (cfg.get("architectures") or ["?"])[0]
        if arch not in LLAMA_LIKE:
            raise ModelLoadError(f"{name}: architecture {arch} is not supported; kiln.llm loads "
                                 f"{', '.join(LLAMA_LIKE)}")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=cfg.get("rope_theta", 1e4),
            rope_scaling=cfg.get("rope_scaling"),
            max_position=cfg.get("max_position_embeddings", 4096),
            tie_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", arch == "Qwen2ForCausalLM"),
            bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos, name=name)

    @classmethod
    def from_gguf(cls, md: dict, has_output: bool, name: str = "model") -> ModelConfig:
        arch = md.get("general.architecture")
        if arch not in ("llama", "mistral", "qwen2"):
            raise ModelLoadError(f"{name}: GGUF architecture {arch!r} is not supported; kiln.llm "
                                 "loads llama, mistral and qwen2")

        def get(key, default=None):
            return md.get(f"{arch}.{key}", default)

        heads, hidden = get("attention.head_count"), get("embedding_length")
        scaling = None
        if get("rope.scaling.type") not in (None, "none"):
            scaling = {"rope_type": get("rope.scaling.type"),
                       "factor": get("rope.scaling.factor", 1.0),
                       "original_max_position_embeddings":
                           get("rope.scaling.original_context_length")}
        eos = md.get("tokenizer.ggml.eos_token_id")
        return cls(
            vocab_size=get("vocab_size") or len(md["tokenizer.ggml.tokens"]),
            hidden_size=hidden, intermediate_size=get("feed_forward_length"),
            num_layers=get("block_count"), num_heads=heads,
            num_kv_heads=get("attention.head_count_kv", heads),
            head_dim=get("rope.dimension_count") or hidden // heads,
            rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-6),
            rope_theta=get("rope.freq_base", 1e4), rope_scaling=scaling,
            max_position=get("context_length", 4096), tie_embeddings=not has_output,
            attention_bias=arch == "qwen2", bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (eos,), name=name)

    def to_hf(self) -> dict:
        """A transformers ``LlamaConfig`` dict of the same model (for comparisons)."""
        return dict(
            architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=self.vocab_size,
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling, max_position_embeddings=self.max_position,
            tie_word_embeddings=self.tie_embeddings, attention_bias=self.attention_bias,
            hidden_act="silu", bos_token_id=self.bos_token_id,
            eos_token_id=list(self.eos_token_ids) or None)

    def weight_bytes(self, itemsize: int) -> int:
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        q = self.num_heads * self.head_dim
        layer = h * (q + 2 * kv) + q * h + 3 * h * self.intermediate_size + 2 * h
        head = 0 if self.tie_embeddings else self.vocab_size * h
        return (self.num_layers * layer + self.vocab_size * h + head + h) * itemsize


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies of the rotary embedding and the factor on cos/sin (YaRN's mscale).

    Scaling variants (``rope_scaling``): ``linear`` (positions / factor), ``llama3`` (long
    wavelengths / factor, short kept, smooth in between), ``yarn`` (NTK-by-parts blend plus an
    attention factor), ``dynamic`` (NTK base growth, fixed at ``max_position``).
    """
    dim, base = cfg.head_dim, cfg.rope_theta
    inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    sc = cfg.rope_scaling or {}
    kind = sc.get("rope_type") or sc.get("type") or "default"
    if kind == "default":
        return inv.float(), 1.0
    factor = float(sc.get("factor", 1.0))
    if kind == "linear":
        return (inv / factor).float(), 1.0
    if kind == "llama3":
        return _llama3(inv, sc, factor).float(), 1.0
    if kind == "yarn":
        return _yarn(cfg, inv, sc, factor)
    if kind == "dynamic":
        # NTK: base * (factor * L / L0 - (factor - 1)) ** (d / (d - 2)) at L = max_position
        orig = sc.get("original_max_position_embeddings") or cfg.max_position
        grown = base * (factor * cfg.max_position / orig - (factor - 1)) ** (dim / (dim - 2))
        inv = 1.0 / grown ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        return inv.float(), 1.0
    raise ModelLoadError(f"{cfg.name}: rope_scaling type {kind!r} is not supported (kiln "
                         "knows default, linear, llama3, yarn, dynamic)")


def _llama3(inv: torch.Tensor, sc: dict, factor: float) -> torch.Tensor:
    lo, hi = sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
    orig = sc.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv
    smooth = (orig / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * inv / factor + smooth * inv
    out = torch.where(wavelen > orig / lo, inv / factor, inv)
    mid = (wavelen <= orig / lo) & (wavelen >= orig / hi)
    return torch.where(mid, blended, out)


def _yarn(cfg: ModelConfig, inv: torch.Tensor, sc: dict, factor: float):
    dim, base = cfg.head_dim, cfg.rope_theta
    orig = sc.get("original_max_position_embeddings") or cfg.max_position
    fast, slow = sc.get("beta_fast", 32), sc.get("beta_slow", 1)

    def dim_of(rotations):  # the dimension whose wavelength fits `rotations` times in orig
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(dim_of(fast)), 0), min(math.ceil(dim_of(slow)), dim - 1)
    ramp = (torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)
    extrapolate = 1 - ramp.clamp(0, 1)
    out = inv / factor * (1 - extrapolate) + inv * extrapolate
    mscale = sc.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    return out.float(), float(mscale)
