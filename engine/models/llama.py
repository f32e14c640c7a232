"""Llama-layout decoder (Llama 3.x, SmolLM, Mistral, Qwen2/2.5, Qwen3, Phi-3) over one
flattened varlen token batch, and the layers the other families (engine/models/gemma.py) share.

Names follow HF checkpoints, except that q/k/v and gate/up are fused into one matmul each.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.config import ModelConfig
from engine.models.forward_context import get_forward_context, step_lora
from kernels.cpu import ops as cpu_ops

if TYPE_CHECKING:
    from engine.models.lora_batch import LoraBatch
    from kernels.cpu.lora import SlotWeights


# NOTE: the fast-path slots below (RMSNorm.fused, MLP.fused, LlamaForCausalLM.fused_cpu_ops
# and .decode_stack) are filled by engine/models/accelerate.py after loading; left empty, the
# model runs its torch formulas, the reference every fast path is tested against.
class FusedMLP(Protocol):
    """An MLP's whole forward in one call (quant_linear.QuantMLP) for the batches it fits,
    with the step's LoRA deltas once the adapters' slots are attached (engine/run/lora)."""

    def fits(self, x: torch.Tensor, lora: LoraBatch | None) -> bool: ...
    def __call__(self, x: torch.Tensor, lora: LoraBatch | None) -> torch.Tensor: ...
    def attach_lora(self, gate_up: SlotWeights, down: SlotWeights) -> None: ...


class FusedStack(Protocol):
    """A plain decode step's whole layer stack and final norm in one call
    (fused_stack.DecodeStack) for the steps it fits, with the step's LoRA deltas once the
    adapters' slots are attached (per layer: qkv, o, gate_up, down)."""

    def fits(self, x: torch.Tensor, positions: torch.Tensor, num_layers: int | None) -> bool: ...
    def __call__(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                 local_rope: RotaryEmbedding | None, num_layers: int | None) -> torch.Tensor: ...
    def attach_lora(self, layers: list[tuple[SlotWeights, ...]]) -> None: ...


def linear(in_features: int, out_features: int, bias: bool = False) -> nn.Module:
    """Every projection of the models is built here (one place to swap in other linears)."""
    return nn.Linear(in_features, out_features, bias=bias)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.fused = False  # kernels/cpu/ops.py's one-pass kernel (accelerate.py sets it)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """weight * RMSNorm(x); with `residual`, (normed, new residual): the new residual is
        residual + x (the fused kernel writes it into `residual`), normed is its norm."""
        if self.fused and cpu_ops.fits(x, self.weight) and (
                residual is None or cpu_ops.fits(residual)):
            out = cpu_ops.add_rms_norm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, residual)
        if residual is None:
            return self._norm(x)
        residual = residual + x
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: same op order as HF (normalize in float32, then scale) for token parity.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> tuple[torch.Tensor, float]:
    """Inverse frequencies with the config's theta and scaling (default, linear, llama3, a
    GGUF's per-pair factors, longrope's short factor), and the factor cos and sin are scaled
    by. local: Gemma 3's windowed layers (their own base, no scaling)."""
    dim = cfg.head_dim
    theta = cfg.local_rope_theta if local else cfg.rope_theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (theta**exponents)
    scaling = {} if local else cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if kind == "freq_factors":  # NOTE: a GGUF's rope_freqs tensor (loader.py)
        factors = torch.tensor(scaling["factors"], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope_freqs has {factors.numel()} factors; the head dim "
                             f"{dim} has {inv_freq.numel()} rotary pairs")
        return inv_freq / factors, 1.0
    if kind == "longrope":  # NOTE: the short factor: config.py caps the context to match
        short = torch.tensor(scaling["short_factor"], dtype=torch.float32)
        return 1.0 / (short * theta**exponents), float(scaling["attention_factor"])
    raise ValueError(f"rope scaling {kind!r} is not supported")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin tables for every position; `lookup` takes one batch's rows for every layer."""

    def __init__(self, cfg: ModelConfig, max_positions: int, device: torch.device,
                 local: bool = False) -> None:
        inv_freq, factor = rope_inv_freq(cfg, local)
        freqs = torch.outer(torch.arange(max_positions, device=device).float(), inv_freq.to(device))
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.cos, sin = emb.cos(), emb.sin()
        if factor != 1.0:
            self.cos, sin = self.cos * factor, sin * factor
        # NOTE: HF's rotate_half(x) * sin is cat(-x2, x1) * sin; with the sign moved into the
        # table it is cat(x2, x1) * cat(-sin1, sin2): the same products, one op fewer.
        half = sin.shape[-1] // 2
        self.sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype, fused: bool = False):
        """The batch's tables; fused: kernels/cpu/ops.py indexes the full ones where it can."""
        fused = fused and dtype == torch.float32 and cpu_ops.rope_fits(positions, self.cos)
        return RopeTables(self, positions, dtype, fused)


class RopeTables:
    """One batch's cos and signed sin rows, [num_tokens, 1, head_dim] each (looked up once for
    every layer), or for the fused kernel the positions into the full tables."""

    def __init__(self, rope: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype,
                 fused: bool) -> None:
        self.rope, self.positions, self.dtype, self.fused = rope, positions, dtype, fused
        self.cos = self.sin = None
        if not fused:
            self._lookup()

    def _lookup(self) -> None:
        self.cos = self.rope.cos[self.positions].unsqueeze(1).to(self.dtype)
        self.sin = self.rope.sin[self.positions].unsqueeze(1).to(self.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, heads, head_dim]; rotate-half layout as in HF Llama
        if self.fused and cpu_ops.rope_input_fits(x):
            return cpu_ops.rope(x, self.positions, self.rope.cos, self.rope.sin)
        if self.cos is None:
            self._lookup()
        half = x.shape[-1] // 2
        swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
        return x * self.cos + swapped * self.sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = cfg.attn_scale or self.head_dim**-0.5
        self.window = cfg.window(layer_idx)
        self.softcap = cfg.attn_softcap
        # per-head norms of q and k before rope (Qwen3, Gemma 3)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        # FP8 KV cache scales from the checkpoint, [] (per tensor) or [num_kv_heads] (per head),
        # float32: the cache holds x / scale. None is scale 1. Used only with an FP8 cache.
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, rope: RopeTables):
        n = x.shape[0]
        qkv = self.qkv_proj(x).view(n, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk = qkv[:, : self.num_heads + self.num_kv_heads]
        if self.q_norm is not None:
            qk = self._norm_qk(qk)
        # NOTE: q and k rotate in one call; q and k are then views of its output
        q, k = rope(qk).split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.num_heads + self.num_kv_heads :]
        ctx = get_forward_context()
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        meta = ctx.attn_metadata
        fp8 = k_cache.element_size() == 1
        scales = {"k_scale": self.k_scale if fp8 else None,
                  "v_scale": self.v_scale if fp8 else None}
        ctx.backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, **scales)
        if self.softcap is not None:
            scales["softcap"] = self.softcap
        out = ctx.backend.paged_attention(q, k_cache, v_cache, meta.with_window(self.window),
                                          self.scale, **scales)
        return self.o_proj(out.reshape(n, self.q_size))

    def _norm_qk(self, qk: torch.Tensor) -> torch.Tensor:
        """q and k [tokens, heads, head_dim] each normed per head: in place by ops.c's kernel
        where the norms are fused (the numbers of engine/models/fused_stack.py's driver), else
        by torch."""
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        qw, kw = self.q_norm.weight, self.k_norm.weight
        if self.q_norm.fused and cpu_ops.rope_input_fits(qk) and cpu_ops.fits(qw, kw):
            cpu_ops.rms_norm_heads(q, qw, self.q_norm.eps)
            cpu_ops.rms_norm_heads(k, kw, self.k_norm.eps)
            return qk
        return torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gelu = cfg.hidden_act == "gelu_tanh"
        # the whole MLP in one call for decode-sized batches (accelerate.py sets it where both
        # projections are packed quantized layers)
        self.fused: FusedMLP | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            lora = step_lora()
            if self.fused.fits(x, lora):
                return self.fused(x, lora)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(act * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        # Gemma 3: the windowed layers rotate with the local rope base
        self.uses_local_rope = (cfg.local_rope_theta is not None
                                and cfg.window(layer_idx) is not None)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: RopeTables):
        """x: the previous layer's output (the embedding at layer 0, residual None). Returns
        this layer's output and the residual stream before it, which the next norm adds in
        (their sum is HF's hidden state between layers)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, rope), residual)
        return self.mlp(h), residual


# FP8 KV cache scales as quantized checkpoints name them (vLLM's conventions) -> k, v or both.
_KV_SCALES = {
    "self_attn.k_scale": "k", "self_attn.v_scale": "v", "self_attn.kv_scale": "kv",
    "self_attn.k_proj.output_scale": "k", "self_attn.v_proj.output_scale": "v",
}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


def kv_scale_name(name: str) -> tuple[int, str] | None:
    """(layer, "k" | "v" | "kv") when `name` (without "model.") is a KV cache scale."""
    m = _LAYER.fullmatch(name)
    if m is None or m.group(2) not in _KV_SCALES:
        return None
    return int(m.group(1)), _KV_SCALES[m.group(2)]


# HF checkpoint name -> (our fused parameter, shard index) for the fused projections.
_STACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    layer_class: type[nn.Module] = DecoderLayer

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # NOTE: no random init (the checkpoint overwrites it): under torch.device("meta") the
        # init's normal_ imports torch._dynamo and triton, 144 MiB of resident memory. Built
        # off the meta device and not loaded, the table is uninitialised memory.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(self.layer_class(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # NOTE: a sequence classifier (cross-encoder) has a score head instead of an LM head:
        # it only pools (engine/run/pooling.py), and the engine refuses to generate with it
        classifier = cfg.num_labels is not None
        self.lm_head = None if cfg.tie_word_embeddings or classifier else linear(
            cfg.hidden_size, cfg.vocab_size, bias=False)
        self.score = linear(cfg.hidden_size, cfg.num_labels) if classifier else None
        self.rope: RotaryEmbedding | None = None
        self.local_rope: RotaryEmbedding | None = None  # Gemma 3's windowed layers
        self.fused_cpu_ops = False  # rope in kernels/cpu/ops.py's C kernel (accelerate.py)
        # a plain decode step's whole stack in one C call (engine/models/fused_stack.py),
        # installed by accelerate.py where every layer is a packed quantized one
        self.decode_stack: FusedStack | None = None

    def init_rope(self, max_positions: int, device: torch.device) -> None:
        self.rope = RotaryEmbedding(self.cfg, max_positions, device)
        if self.cfg.local_rope_theta is not None:
            self.local_rope = RotaryEmbedding(self.cfg, max_positions, device, local=True)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, num_layers: int | None = None
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden_size].

        num_layers: run only the first layers, then the final norm (the self-draft model).
        """
        assert self.rope is not None, "call init_rope() first"
        x = self.embed(input_ids)
        stack = self.decode_stack
        if stack is not None and stack.fits(x, positions, num_layers):
            return stack(x, positions, self.rope, self.local_rope, num_layers)
        rope = self.rope.lookup(positions, x.dtype, self.fused_cpu_ops)
        local = rope if self.local_rope is None else self.local_rope.lookup(
            positions, x.dtype, self.fused_cpu_ops)
        residual = None
        for layer in self.layers[:num_layers]:
            x, residual = layer(x, residual, local if layer.uses_local_rope else rope)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:  # tied to the embedding
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into our parameters; returns the names of loaded parameters."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
                continue
            if (scale := kv_scale_name(name)) is not None:
                self.set_kv_scale(*scale, tensor)
                continue
            target, shard = self._target(name)
            if target not in params:
                raise KeyError(f"unexpected weight {hf_name!r}")
            if self.cfg.norm_offset and target.endswith("norm.weight"):
                tensor = tensor.float() + self.cfg.norm_offset  # Gemma's (1 + w)
            self._copy(params[target], tensor, target, shard)
            loaded.add(target)
        missing = set(params) - loaded
        if missing:
            raise KeyError(f"weights missing from the checkpoint: {sorted(missing)[:5]}")
        return loaded

    def set_kv_scale(self, layer: int, which: str, tensor: torch.Tensor) -> None:
        """Attach a checkpoint's FP8 KV cache scale: one value, or one per (local) KV head."""
        if not 0 <= layer < len(self.layers):
            raise ValueError(f"a KV cache scale for layer {layer}, but the model has "
                             f"{len(self.layers)} layers")
        scale = tensor.detach().float().reshape(-1)
        heads = self.cfg.num_kv_heads
        if scale.numel() not in (1, heads) or not bool((scale > 0).all()):
            raise ValueError(f"layer {layer} {which}_scale must be one positive value or "
                             f"{heads} (one per KV head); got shape {tuple(tensor.shape)}")
        scale = (scale[0] if scale.numel() == 1 else scale).to(self.embed_tokens.weight.device)
        attn = self.layers[layer].self_attn
        if "k" in which:
            attn.k_scale = scale
        if "v" in which:
            attn.v_scale = scale

    @staticmethod
    def _target(name: str) -> tuple[str, int | None]:
        for hf_part, (ours, shard) in _STACKED.items():
            if f".{hf_part}." in name:
                return name.replace(hf_part, ours), shard
        return name, None

    def _copy(self, param: nn.Parameter, tensor: torch.Tensor, name: str, shard: int | None):
        with torch.no_grad():
            if shard is None:
                param.copy_(tensor)
                return
            cfg = self.cfg
            if "qkv_proj" in name:
                q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
                sizes = [q, kv, kv]
            else:
                sizes = [cfg.intermediate_size] * 2
            start = sum(sizes[:shard])
            param[start : start + sizes[shard]].copy_(tensor)
