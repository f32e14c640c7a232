"""A decode step's decoder stack in one C call (csrc/fused.c) over quantized layers, packed
tiles or raw-block segments: the driver calls ops.c's norms and rope, quant_packed.c's,
quant_kpacked.c's or mlp_blocks.c's products, mlp.c's, quant_kpacked.c's or mlp_blocks.c's
MLP, decode.c's KV write and decode attention and lora.c's per-row LoRA deltas directly, all
in the one CPU library (kernels/cpu/library.py).

NOTE: 30 layers of SmolLM2-135M cost about 2.9 ms of Python and torch per decoded token
between the kernels (a8: 9.2 ms per token, of which the products 5.3 and attention 1.0).
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from kernels.cpu import library
from kernels.cpu.blocks import BlockParts, PackedSegment, Segment
from kernels.cpu.decode import MAX_BLOCK, MAX_GROUP, MAX_ROWS
from kernels.cpu.library import available, build_error
from kernels.cpu.lora import LoraWeights, SlotWeights
from kernels.cpu.quant import ACTIVATIONS, NUMERICS, fuses

if TYPE_CHECKING:
    from kernels.attention import Backend

__all__ = ["KV_DTYPES", "DecodeStack", "LayerWeights", "available", "build_error", "runs_with"]

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_PRODUCTS = ("qkv", "o", "gate_up", "down")  # a layer's products, in fused.c's order
_EXTRA_NORMS = ("q_norm", "k_norm", "pre_ff_norm", "post_ff_norm")  # None where a layer has none

# The KV pool dtypes the driver takes (decode.c's float32 and float16 entry points).
KV_DTYPES = (torch.float32, torch.float16)


class _Shape(ctypes.Structure):
    _fields_ = [*[(n, _i64) for n in ("hidden", "inter", "heads", "kv_heads", "head_dim",
                                      "block_size", "num_slots")],
                ("eps", _f32), ("scale", _f32), ("numerics", ctypes.c_int),
                ("act", ctypes.c_int), ("kv_f16", ctypes.c_int), ("lora_slots", _i64)]


class _Product(ctypes.Structure):
    _fields_ = [("packed", _i64), ("blocks", BlockParts)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _ptr), ("post_norm", _ptr),
                *[(n, _Product) for n in _PRODUCTS],
                ("k_cache", _ptr), ("v_cache", _ptr),
                *[(f"{n}_lora", LoraWeights) for n in _PRODUCTS],
                *[(n, _ptr) for n in _EXTRA_NORMS], ("window", _i64), ("local", _i64)]


def _product(segments: list[Segment] | list[PackedSegment], packed: bool, k: int) -> _Product:
    if packed:
        return _Product(1, BlockParts.of_packed(segments, k))
    return _Product(0, BlockParts.of(segments, k))


def runs_with(backend: Backend) -> bool:
    """The attention backend whose kernels the driver calls: the cpu one (by its NAME)."""
    return available() and backend.NAME == "cpu"


class LayerWeights:
    """One layer's tensors: norms float32 [hidden]; the products qkv [(heads + 2 kv_heads)
    head_dim, hidden] (q, k, v rows in that order), o [hidden, heads head_dim], gate_up
    [2 inter, hidden] (gate rows first), down [hidden, inter], each as row segments stacked
    in order: packed tiles (kernels/cpu/blocks.py's PackedSegment: kernels/cpu/quant.py's
    `pack` of each part) with packed True, or raw blocks [rows, row_bytes] (its Segment) with
    packed False (`packed`: one flag per product, in that order). gate_up and down are both
    packed or both raw; packed, one segment each, of one library's types (quant.fuses).

    Beyond the Llama layer: q_norm and k_norm float32 [head_dim] (Qwen3's and Gemma 3's
    per-head norms of q and k before rope; both or neither); pre_ff_norm and post_ff_norm
    float32 [hidden] (Gemma's sandwich: post_norm then norms attention's output alone,
    pre_ff_norm is the add + norm before the MLP, post_ff_norm norms the MLP's output; both
    or neither); window: the last keys a query sees (None: all); local: rope with the local
    tables (Gemma 3's windowed layers)."""

    def __init__(self, input_norm: torch.Tensor, post_norm: torch.Tensor,
                 qkv: list[Segment] | list[PackedSegment],
                 o: list[Segment] | list[PackedSegment],
                 gate_up: list[Segment] | list[PackedSegment],
                 down: list[Segment] | list[PackedSegment],
                 packed: tuple[bool, bool, bool, bool], *,
                 q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                 pre_ff_norm: torch.Tensor | None = None,
                 post_ff_norm: torch.Tensor | None = None, window: int | None = None,
                 local: bool = False) -> None:
        self.input_norm, self.post_norm = input_norm, post_norm
        if (q_norm is None) != (k_norm is None) or (pre_ff_norm is None) != (post_ff_norm is None):
            raise ValueError("q_norm and k_norm, pre_ff_norm and post_ff_norm come in pairs")
        if window is not None and window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        self.norms = dict(zip(_EXTRA_NORMS, (q_norm, k_norm, pre_ff_norm, post_ff_norm),
                              strict=True))
        self.window, self.local = window or 0, local
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down
        if packed[2] != packed[3]:
            raise ValueError("gate_up and down must be both packed or both raw blocks")
        if packed[2] and (len(gate_up) != 1 or len(down) != 1
                          or not fuses(gate_up[0][1], down[0][1])):
            raise ValueError("packed gate_up and down must be one segment each, of one "
                             "library's types")
        self.packed = dict(zip(_PRODUCTS, packed, strict=True))

    def all_norms(self) -> list[tuple[str, torch.Tensor]]:
        """(name, weight) of every norm the layer has."""
        return [("input_norm", self.input_norm), ("post_norm", self.post_norm),
                *((n, t) for n, t in self.norms.items() if t is not None)]


class DecodeStack:
    """One model's prepared call: the layer table is built once, the KV pool pointers when
    the caches change (`set_caches`), the step's metadata per call."""

    def __init__(self, layers: list[LayerWeights], final_norm: torch.Tensor, *, hidden: int,
                 inter: int, heads: int, kv_heads: int, head_dim: int, eps: float,
                 scale: float, numerics: str, act: str) -> None:
        if not available():
            raise RuntimeError(f"the CPU library cannot run here: {build_error()}")
        sizes = {"q_norm": head_dim, "k_norm": head_dim}
        for t, size in ((final_norm, hidden), *((t, sizes.get(n, hidden))
                                                for w in layers for n, t in w.all_norms())):
            if t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != size:
                raise ValueError(f"norm weights must be contiguous float32 [{size}]")
        self._keep = (layers, final_norm)  # NOTE: the table holds their raw addresses
        self._table = (_Layer * len(layers))()
        for row, w in zip(self._table, layers, strict=True):
            row.input_norm, row.post_norm = w.input_norm.data_ptr(), w.post_norm.data_ptr()
            for name, k in zip(_PRODUCTS, (hidden, heads * head_dim, hidden, inter),
                               strict=True):
                setattr(row, name, _product(getattr(w, name), w.packed[name], k))
            for name, t in w.norms.items():
                setattr(row, name, None if t is None else t.data_ptr())
            row.window, row.local = w.window, w.local
        self._shape = _Shape(hidden, inter, heads, kv_heads, head_dim, 0, 0, eps, scale,
                             NUMERICS[numerics], ACTIVATIONS[act])
        self._final = final_norm.data_ptr()
        self._caches: list | None = None  # the pools the table points at
        self._lora: list | None = None  # the LoRA slots the table points at (set_lora)
        self._checked: tuple[list, bool] | None = None  # the last pools checked, and the answer
        self.num_layers, self.hidden = len(layers), hidden
        self.local = any(w.local for w in layers)  # the call needs the local rope tables

    def caches_fit(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Contiguous CPU pools [blocks, block_size, kv_heads, head_dim] of a dtype in
        KV_DTYPES, one per layer, of one shape and dtype, in sizes the decode kernel
        takes (kernels/cpu/decode.py's limits)."""
        if kv_caches is self._caches:
            return True
        if self._checked is not None and self._checked[0] is kv_caches:
            return self._checked[1]  # NOTE: pools that did not fit: not checked every step
        fit = self._caches_fit(kv_caches)
        self._checked = (kv_caches, fit)
        return fit

    def _caches_fit(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        s = self._shape
        if len(kv_caches) < self.num_layers:
            return False
        shape, dtype = kv_caches[0][0].shape, kv_caches[0][0].dtype
        group = s.heads // s.kv_heads
        return (len(shape) == 4 and tuple(shape[2:]) == (s.kv_heads, s.head_dim)
                and dtype in KV_DTYPES and shape[1] <= MAX_BLOCK
                and group <= MAX_GROUP and group * s.head_dim <= MAX_ROWS
                and all(c.dtype == dtype and c.device.type == "cpu"
                        and c.is_contiguous() and c.shape == shape
                        for pair in kv_caches[: self.num_layers] for c in pair))

    def set_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Point the layer table at these pools (caches_fit said they fit).
        NOTE: pools are known by the list object: the runner builds its list once, and swap,
        copy-on-write and prefix caching copy into its tensors in place; whoever replaced a
        tensor in that list would have to pass a new list (or the C side reads freed memory)."""
        if kv_caches is self._caches:
            return
        for row, (k, v) in zip(self._table, kv_caches, strict=False):
            row.k_cache, row.v_cache = k.data_ptr(), v.data_ptr()
        shape = kv_caches[0][0].shape
        self._shape.kv_f16 = kv_caches[0][0].dtype == torch.float16
        self._shape.block_size = shape[1]
        self._shape.num_slots = shape[0] * shape[1]
        self._caches = kv_caches

    def set_lora(self, layers: list[tuple[SlotWeights, SlotWeights, SlotWeights, SlotWeights]]
                 ) -> None:
        """Point the layer table at each layer's LoRA slots of qkv, o, gate_up and down (one
        slot count for all; SlotWeights.runs_in_c holds); rows with an adapter get their
        deltas from then on."""
        if len(layers) != self.num_layers:
            raise ValueError(f"LoRA slots for {len(layers)} layers; the stack has "
                             f"{self.num_layers}")
        counts = {w.a.shape[0] for ws in layers for w in ws}
        if len(counts) != 1 or not all(w.runs_in_c() for ws in layers for w in ws):
            raise ValueError("LoRA slots must be contiguous float32 CPU tensors, one count")
        for row, weights in zip(self._table, layers, strict=True):
            for name, w in zip(_PRODUCTS, weights, strict=True):
                setattr(row, f"{name}_lora", w.struct())
        self._shape.lora_slots = counts.pop()
        self._lora = layers  # NOTE: the table holds their raw addresses

    @property
    def has_lora(self) -> bool:
        return self._lora is not None

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 tables: torch.Tensor, seq_lens: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, num_layers: int, num_threads: int,
                 adapters: torch.Tensor | None = None,
                 local: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The final norm of layer num_layers's hidden states, [rows, hidden].

        x float32 [rows, hidden] contiguous; positions, slots int64 [rows]; tables int64
        [rows, >= blocks] with contiguous rows; seq_lens int32 [rows]; cos, sin float32
        [max_positions, head_dim] contiguous (the signed sin of engine/models/llama.py's
        RotaryEmbedding); adapters: each row's LoRA slot, int32 [rows] contiguous, -1 for
        none (None: no row has one; else set_lora was called); local: the local layers' cos
        and sin, as cos and sin (needed where a layer is local). Not checked here: the
        caller's fits() did.
        """
        if self.local and local is None:
            raise ValueError("the stack has local layers: pass their rope tables")
        local_cos, local_sin = (None, None) if local is None else (t.data_ptr() for t in local)
        rows = x.shape[0]
        out = torch.empty(rows, self.hidden, dtype=torch.float32)
        rc = library.load().fused_decode_stack(
            ctypes.addressof(self._shape),
            ctypes.addressof(self._table), num_layers, x.data_ptr(), rows,
            positions.data_ptr(), slots.data_ptr(), tables.data_ptr(), tables.stride(0),
            seq_lens.data_ptr(), None if adapters is None else adapters.data_ptr(),
            cos.data_ptr(), sin.data_ptr(), local_cos, local_sin, self._final, out.data_ptr(),
            num_threads)
        if rc == -2:
            raise IndexError("KV cache slots out of range")
        if rc:
            raise RuntimeError("fused_decode_stack failed")
        return out
