"""The decoder stack of a plain decode step in one C call (kernels/cpu/fused.py) for
Llama-layout models (and Qwen3's q/k norms, Gemma 2/3's sandwich norms, windows and local
rope) whose projections are all quantized: packed tiles (Q4_0/Q4_1/Q8_0 and the K-quants, on
AVX-512 VNNI), or raw-block segments where the CPU or the type has no packed tiles (every type
on an AVX2-only CPU).

`DecodeStack.build(model)` says whether a model qualifies (else None: its layers always run
one by one); `fits` decides per step (every row one token, KV pools of a dtype the driver
takes: kernels/cpu/fused.py's KV_DTYPES, the `cpu` attention backend), and the
per-layer path runs whatever it does not take: prefill and mixed steps, speculative
verification, the FP8 cache, the torch backend. Rows with a LoRA adapter get their deltas
in the same call once engine/run/lora's slots are attached (`attach_lora`).
"""

from __future__ import annotations

import torch

from engine.models.forward_context import get_forward_context
from engine.models.gemma import GemmaDecoderLayer
from engine.models.llama import DecoderLayer, LlamaForCausalLM, RotaryEmbedding
from engine.models.quant_linear import PREFILL_ROWS, QuantLinear, QuantMLP
from kernels.cpu import fused as cpu_fused
from kernels.cpu.blocks import PackedSegment, Segment
from kernels.cpu.lora import SlotWeights


class DecodeStack:
    """A model's layers as one kernels/cpu/fused.py call; `calls` counts the steps it ran,
    `partial_calls` those of the first layers only (self drafts)."""

    def __init__(self, kernel: cpu_fused.DecodeStack) -> None:
        self.kernel = kernel
        self.calls = self.partial_calls = 0

    @classmethod
    def build(cls, model: LlamaForCausalLM) -> DecodeStack | None:
        """The stack for `model`, or None where a layer has anything the driver lacks (biases,
        attention soft-caps, dense segments, packed parts beside raw ones, a dense MLP) or the
        C kernels cannot run here."""
        eps = model.cfg.rms_norm_eps
        layers = [_layer_weights(layer, eps) for layer in model.layers]
        if not layers or None in layers or not cpu_fused.available():
            return None
        attns = [layer.self_attn for layer in model.layers]
        mlps = [layer.mlp.fused for layer in model.layers]
        numerics = {m.numerics for m in mlps} | {
            p.numerics for a in attns for p in (a.qkv_proj, a.o_proj)}
        if len({a.scale for a in attns}) != 1 or len(numerics) != 1 or len(
                {m.act for m in mlps}) != 1:
            return None
        cfg = model.cfg
        norm = model.norm.weight.detach()
        if norm.dtype != torch.float32 or model.norm.eps != eps:
            return None
        kernel = cpu_fused.DecodeStack(
            layers, norm, hidden=cfg.hidden_size, inter=mlps[0].inter, heads=cfg.num_heads,
            kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, eps=eps,
            scale=attns[0].scale, numerics=numerics.pop(), act=mlps[0].act)
        return cls(kernel)

    def attach_lora(self, layers: list[tuple[SlotWeights, ...]]) -> None:
        """The adapters' slots of every layer's qkv, o, gate_up and down (engine/run/lora):
        from then on the stack takes steps with adapter rows too."""
        self.kernel.set_lora(layers)

    def fits(self, x: torch.Tensor, positions: torch.Tensor, num_layers: int | None) -> bool:
        """This step's batch: plain decodes only (one token per sequence, at most
        PREFILL_ROWS rows: a32's packed products stop there; a8's go further, but the stack
        is tested and measured up to 64), tensors and pools the kernels index, the `cpu`
        backend; adapter rows only with the slots attached and the rows' slots in C form."""
        ctx = get_forward_context()
        meta = ctx.attn_metadata
        rows = x.shape[0]
        tables = meta.block_tables
        lora = ctx.lora
        return (0 < rows <= PREFILL_ROWS and meta.num_decodes == rows == meta.num_seqs
                and (lora is None or (self.kernel.has_lora and lora.row_slots is not None
                                      and lora.row_slots.numel() == rows))
                and meta.window is None and (num_layers is None or num_layers >= 0)
                and x.dtype == torch.float32 and x.is_contiguous()
                and positions.dtype == torch.int64 and positions.is_contiguous()
                and meta.slot_mapping.dtype == torch.int64 and meta.slot_mapping.is_contiguous()
                and tables.dtype == torch.int64 and tables.stride(1) == 1
                and meta.seq_lens.dtype == torch.int32 and meta.seq_lens.is_contiguous()
                and cpu_fused.runs_with(ctx.backend) and self.kernel.caches_fit(ctx.kv_caches))

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                 local_rope: RotaryEmbedding | None, num_layers: int | None) -> torch.Tensor:
        """The hidden states after the first num_layers layers (None: all) and the final
        norm, as LlamaForCausalLM.forward returns them (local_rope: the windowed Gemma 3
        layers' tables)."""
        ctx = get_forward_context()
        meta = ctx.attn_metadata
        self.kernel.set_caches(ctx.kv_caches)
        n = self.kernel.num_layers if num_layers is None else min(num_layers,
                                                                  self.kernel.num_layers)
        self.calls += 1
        if n < self.kernel.num_layers:
            self.partial_calls += 1
        adapters = None if ctx.lora is None else ctx.lora.row_slots
        local = None if local_rope is None else (local_rope.cos, local_rope.sin)
        return self.kernel(x, positions, meta.slot_mapping, meta.block_tables, meta.seq_lens,
                           rope.cos, rope.sin, n, torch.get_num_threads(), adapters, local)


def _layer_weights(layer: torch.nn.Module, eps: float) -> cpu_fused.LayerWeights | None:
    """The layer's tensors for the driver, or None where it is not a Llama or Gemma layer
    whose projections are packed products or raw-block segments, whose MLP is one call and
    whose attention has no soft-cap (decode.c has none); its norms' eps must be `eps`, the
    driver's."""
    if type(layer) not in (DecoderLayer, GemmaDecoderLayer):
        return None
    attn, mlp = layer.self_attn, layer.mlp.fused
    if attn.softcap is not None or not isinstance(mlp, QuantMLP):
        return None
    norms = {"input_norm": layer.input_layernorm, "post_norm": layer.post_attention_layernorm}
    if attn.q_norm is not None:
        norms.update(q_norm=attn.q_norm, k_norm=attn.k_norm)
    if isinstance(layer, GemmaDecoderLayer):
        norms.update(pre_ff_norm=layer.pre_feedforward_layernorm,
                     post_ff_norm=layer.post_feedforward_layernorm)
    if any(n.weight.dtype != torch.float32 or n.eps != eps for n in norms.values()):
        return None
    qkv, o = _segments(attn.qkv_proj), _segments(attn.o_proj)
    if qkv is None or o is None:
        return None
    if mlp.segments is None:  # packed tiles (QuantMLP: both of one library's types)
        gate_up = ([(mlp.gate_up.data, mlp.gate_up.type_id, mlp.gate_up.rows)], True)
        down = ([(mlp.down.data, mlp.down.type_id, mlp.down.rows)], True)
    else:
        gate_up, down = ((segments, False) for segments in mlp.segments)
    products = {"qkv": qkv, "o": o, "gate_up": gate_up, "down": down}
    return cpu_fused.LayerWeights(
        **{name: segments for name, (segments, _) in products.items()},
        packed=tuple(packed for _, packed in products.values()), window=attn.window,
        local=layer.uses_local_rope, **{name: n.weight.detach() for name, n in norms.items()})


def _segments(proj: torch.nn.Module) -> tuple[list[Segment | PackedSegment], bool] | None:
    """A projection's (segments, packed) for the driver, or None where it has a bias or a
    dense part, or mixes packed and raw parts."""
    if not isinstance(proj, QuantLinear):
        return None
    packed = proj.packed_segments
    if packed is not None:
        return packed, True
    segments = proj.block_segments
    return None if segments is None else (segments, False)
