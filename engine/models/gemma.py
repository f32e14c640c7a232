"""Gemma 2 and Gemma 3 text decoders: the Llama layout with norms around attention and the
MLP, scaled embeddings and optional tanh soft-capping of the logits (engine/models/llama.py
has the layers; config.py the flags: GeGLU, (1 + w) norms, windows, q/k norms, local rope)."""

from __future__ import annotations

import torch

from engine.models.config import ModelConfig
from engine.models.llama import MLP, Attention, LlamaForCausalLM, RMSNorm, RopeTables


class GemmaDecoderLayer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)  # on attention's output
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.mlp = MLP(cfg)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.uses_local_rope = (cfg.local_rope_theta is not None
                                and cfg.window(layer_idx) is not None)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: RopeTables):
        """As DecoderLayer's: (this layer's output, the residual stream before it). HF:
        h = x + post_attn(attn(in(x))); out = h + post_ff(mlp(pre_ff(h)))."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, rope))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class GemmaForCausalLM(LlamaForCausalLM):
    layer_class = GemmaDecoderLayer

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # NOTE: HF multiplies by sqrt(hidden) rounded to the embedding's dtype
        return x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.cfg.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
