"""Linear and embedding layers whose weights stay in GGUF blocks (kernels/cpu/quant.py).

`install_quantized(model, weights, numerics)` is the one hook a model family needs: given the
HF-named weights of a checkpoint as `QuantWeight`s (raw blocks from a GGUF, or Q8_0 blocks made
at load by `quantize_q8_0` for `--quantization int8`), it replaces each `nn.Linear` whose parts
are all there by a `QuantLinear`, the embedding by a `QuantEmbedding`, and a tied LM head by a
`QuantLinear` over the embedding's blocks. Fused projections (qkv, gate/up) are found through
the model's own `_target(name) -> (parameter, shard)`, so every family that loads its fused
weights that way gets quantized layers without code of its own. A fused layer's parts may
have different types (Q4_K_M files mix Q4_K and Q6_K): each part is a segment multiplied on
its own into its slice of the output.

Numerics (`--quantization-numerics`): `a32` (weights expanded to float32 in registers, the
dequantized model's product up to summation order) or `a8` (activations quantized to int8 per
32 values, integer dot products). In a32, products of more than PREFILL_ROWS rows (prefill
chunks) expand tiles of weights to float32 once and multiply them with torch's GEMM: the
fastest measured a32 path there. In a8, packed layers keep the integer kernel at every row
count (1.4-3.0x torch's float32 GEMM from 64 to 2048 rows, where expanding and GEMM is
0.86-0.89x of it; `packed_rows_limit`); raw blocks expand past PREFILL_ROWS in both. On AVX-512
VNNI, Q4_0/Q4_1/Q8_0 parts (and Q5_0/Q5_1/Q4_K/Q5_K/Q6_K: kernels/cpu/csrc/quant_kpacked.c) are
repacked into 16-feature tiles (QuantWeight.pack), where a8
is 2.5x a32 at one row (576 -> 3072 Q4_1, two threads: 0.020 against 0.049 ms) and 1.4-1.6x
per decoded token on SmolLM2-135M (server ITL p50 4.4-5.5 against 7.4-7.7 ms). a8 is the
default for a GGUF (engine/models/numerics.py: its KL divergence from the dequantized model
is no worse than llama.cpp's); a32 equals `--quantization none` (and HF) token for token, as
every exact mode must; a8 (int8 activations in prefill too) agrees with HF for 11, 24, 2, 17,
12, 24, 24, 24 of 24 tokens on the parity prompts (bench/RESULTS.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine.models.tile_store import TileStore
from kernels.cpu import blocks as cpu_blocks
from kernels.cpu import lora as cpu_lora
from kernels.cpu import quant as cpu_quant
from kernels.cpu.ggml_types import Q8_0
from kernels.cpu.lora import SlotWeights

if TYPE_CHECKING:
    from engine.models.lora_batch import LoraBatch

log = logging.getLogger(__name__)

NUMERICS = ("a32", "a8")
# NOTE: 576 -> 3072 Q4_1, one thread, a32: the kernel (register tiles up to 7 rows, expanded
# 32-feature tiles from 8) takes 0.20/0.39/0.55/1.06/1.96/3.69 ms at 1/8/16/32/64/128 rows,
# expanding the whole matrix and torch's GEMM 0.63/1.11/1.10/1.25/1.80/2.79 ms (2026-12-01).
PREFILL_ROWS = 64
TILE_FEATURES = 2048  # output features expanded per GEMM tile in the prefill path
# NOTE: `python -m bench.quant_products`, two threads: packed a8 against F.linear on the
# float32 weights, 576 -> 3072 Q4_1: 3.0/1.9/1.6x at 64/512/2048 rows (1536 -> 576: 2.3/1.8/
# 1.4x); expanding tiles + GEMM there is 0.86-0.89x of F.linear. So a8 never expands packed
# tiles; a32's kernel (1.1-2.3x slower than F.linear from 64 rows) does.
_UNLIMITED = 1 << 62


def packed_rows_limit(numerics: str) -> int:
    """The most rows a product runs in the packed kernel for; more expand tiles + GEMM."""
    return PREFILL_ROWS if numerics == "a32" else _UNLIMITED


@dataclass
class QuantWeight:
    """One 2-D weight: raw blocks [rows, row_bytes] of ggml type `type_id` holding `cols`
    weights per row, or (type_id None) a dense float32 tensor [rows, cols]; packed: the
    blocks repacked into kernels/cpu/csrc/quant_packed.c's 16-feature tiles (a 1-D uint8 tensor)."""

    data: torch.Tensor
    type_id: int | None
    rows: int
    cols: int
    packed: bool = False

    def permute_rows(self, index: torch.Tensor) -> QuantWeight:
        assert not self.packed
        return QuantWeight(self.data[index].contiguous(), self.type_id, self.rows, self.cols)

    def pack(self, tiles: TileStore | None = None) -> QuantWeight:
        """The packed form where this CPU and type have the packed kernels, else self; its
        tiles from `tiles` (engine/models/tile_store.py: huge pages, or a file an earlier load
        wrote) when given.
        NOTE: the packed kernels are 2.5-5x faster at 1-8 rows (576 -> 3072 Q4_1, one row,
        two threads: a8 0.020 ms against 0.096 on raw blocks, a32 0.049 against 0.099)."""
        if self.packed or self.type_id is None or not cpu_quant.packs(self.type_id, self.cols):
            return self
        data = (cpu_quant.pack(self.data, self.type_id, self.cols) if tiles is None
                else tiles.pack(self.data, self.type_id, self.rows, self.cols))
        return QuantWeight(data, self.type_id, self.rows, self.cols, packed=True)

    def rows_f32(self, ids: torch.Tensor | None = None, first: int = 0,
                 count: int | None = None) -> torch.Tensor:
        """float32 rows `ids` (or first..first+count) of a quantized weight."""
        if self.packed:
            return cpu_quant.packed_rows(self.data, self.type_id, self.rows, self.cols, ids=ids,
                                         first=first, count=count)
        return cpu_quant.dequantize_rows(self.data, self.type_id, self.cols, ids=ids,
                                         first=first, count=count)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


class QuantLinear(nn.Module):
    """y = x @ W^T (+ bias) with W the row-wise concatenation of `parts`."""

    def __init__(self, parts: list[QuantWeight], bias: torch.Tensor | None,
                 numerics: str, tiles: TileStore | None = None) -> None:
        super().__init__()
        if numerics not in NUMERICS:
            raise ValueError(f"quantization_numerics must be one of {NUMERICS}")
        cols = {p.cols for p in parts}
        if len(cols) != 1:
            raise ValueError(f"the parts of one layer have different widths {sorted(cols)}")
        self.in_features = cols.pop()
        self.out_features = sum(p.rows for p in parts)
        # NOTE: not Parameters or buffers: to_empty() must not replace them
        self.parts = [p.pack(tiles) for p in _merge_same_type(parts)]
        self.numerics = numerics
        self._rows_limit = packed_rows_limit(numerics)
        self.bias = None if bias is None else bias.detach().float()
        one = self.parts[0]
        self._product = cpu_quant.PackedProduct(one.data, one.type_id, one.rows, one.cols,
                                                numerics) if (
            len(self.parts) == 1 and one.packed and self.bias is None) else None
        segments, packed = self.block_segments, self.packed_segments
        if self._product is None and packed is not None:
            # NOTE: parts of different packed types (Q4_K_M's q|k Q4_K and v Q6_K)
            self._product = cpu_blocks.PackedPartsProduct(packed, self.in_features, numerics)
        elif self._product is None and segments is not None:
            self._product = cpu_blocks.BlockProduct(segments, self.in_features, numerics)
            self._rows_limit = PREFILL_ROWS  # NOTE: raw blocks expand past it in both numerics

    @property
    def block_segments(self) -> list[cpu_blocks.Segment] | None:
        """The layer's raw-block parts as (blocks, type id) segments when every part is raw
        quantized blocks and there is no bias (kernels/cpu/blocks.py takes them; so does
        kernels/cpu/csrc/fused.c), else None."""
        if self.bias is not None or any(p.type_id is None or p.packed for p in self.parts):
            return None
        segments = [(p.data, p.type_id) for p in self.parts]
        return segments if cpu_blocks.takes(segments, self.in_features) else None

    @property
    def packed_segments(self) -> list[cpu_blocks.PackedSegment] | None:
        """The layer's parts as (tiles, type id, rows) segments when every part is packed and
        there is no bias (kernels/cpu/blocks.py's PackedPartsProduct takes them; so does
        kernels/cpu/csrc/fused.c), else None."""
        if self.bias is not None or not all(p.packed for p in self.parts):
            return None
        segments = [(p.data, p.type_id, p.rows) for p in self.parts]
        return segments if cpu_blocks.takes_packed(segments, self.in_features) else None

    @property
    def packed_weight(self) -> QuantWeight | None:
        """The layer's one packed part when it is a single packed product without bias (the
        decode fast path; kernels/cpu/csrc/fused.c takes such layers), else None."""
        return self.parts[0] if isinstance(self._product, cpu_quant.PackedProduct) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if (self._product is not None and x.dtype == torch.float32 and x.is_contiguous()
                and x.numel() <= self._rows_limit * self.in_features):
            # NOTE: the decode-sized fast path: one packed part or raw-block segments, no
            # bias, no copies; one C call
            x2 = x.view(-1, self.in_features)
            out = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)
            if x2.shape[0]:
                self._product(x2, out)
            return out.view(*shape[:-1], self.out_features)
        x2 = x.reshape(-1, self.in_features).float()
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        rows = x2.shape[0]
        out = torch.empty(rows, self.out_features, dtype=torch.float32)
        start = 0
        for p in self.parts:
            dst = out[:, start : start + p.rows]
            if p.type_id is None:
                dst.copy_(F.linear(x2, p.data))
            elif p.packed and rows > self._rows_limit:
                tiles = TILE_FEATURES // 16
                for t0 in range(0, (p.rows + 15) // 16, tiles):
                    n0, n = 16 * t0, min(TILE_FEATURES, p.rows - 16 * t0)
                    tile_t = cpu_quant.packed_kmajor(p.data, p.type_id, p.rows, p.cols, t0,
                                                     t0 + (n + 15) // 16)
                    dst[:, n0 : n0 + n] = x2 @ tile_t[:, :n]
            elif p.packed:
                cpu_quant.packed_matmul(x2, p.data, p.type_id, p.rows, p.cols, self.numerics,
                                        out=dst)
            elif rows > PREFILL_ROWS:
                for n0 in range(0, p.rows, TILE_FEATURES):
                    n = min(TILE_FEATURES, p.rows - n0)
                    tile = cpu_quant.dequantize_rows(p.data, p.type_id, p.cols, first=n0, count=n)
                    dst[:, n0 : n0 + n] = x2 @ tile.T
            else:
                cpu_quant.matmul(x2, p.data, p.type_id, p.cols, self.numerics, out=dst)
            start += p.rows
        if self.bias is not None:
            out += self.bias
        return out.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kinds = ",".join(cpu_quant.TYPE_NAMES.get(p.type_id, "F32") for p in self.parts)
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"types={kinds}, numerics={self.numerics}")


def _merge_same_type(parts: list[QuantWeight]) -> list[QuantWeight]:
    """Adjacent block parts of one type as one (row-wise concatenation is byte concatenation):
    one kernel call per type run instead of per checkpoint tensor (q, k, v; gate, up).
    NOTE: a single part is kept as it is, so a tied head shares the embedding's blocks."""
    merged: list[QuantWeight] = []
    for p in parts:
        last = merged[-1] if merged else None
        if last is not None and p.type_id is not None and last.type_id == p.type_id:
            data = torch.cat([last.data, p.data])
            merged[-1] = QuantWeight(data, p.type_id, last.rows + p.rows, p.cols)
        else:
            merged.append(p)
    return merged


class QuantMLP(nn.Module):
    """An MLP's gate/up and down products and its activation in one kernel call for up to
    `packed_rows_limit` rows (any count in a8) of packed layers (cpu_quant.PackedMLP), or up
    to PREFILL_ROWS of raw-block segments (cpu_blocks.BlockMLP: CPUs and types without
    packed tiles), LoRA deltas included once attached; the MLP keeps its own path otherwise.
    engine/models/accelerate.py installs it in llama.MLP's slot.
    NOTE: one call instead of two products and three torch ops per layer: 30-40 us of a
    decode step's per-layer overhead on SmolLM2-135M."""

    def __init__(self, gate_up: QuantLinear, down: QuantLinear, act: str) -> None:
        super().__init__()
        self.act, self.numerics = act, gate_up.numerics
        self.hidden, self.inter = down.out_features, down.in_features
        gu, dn = gate_up.packed_weight, down.packed_weight
        # NOTE: packed [2 inter, hidden] (gate first) and [hidden, inter]; None: raw blocks
        self.gate_up, self.down = gu, dn
        if gu is not None and dn is not None:
            self._rows_limit = packed_rows_limit(gate_up.numerics)
            self._mlp = cpu_quant.PackedMLP(gu.data, gu.type_id, dn.data, dn.type_id,
                                            self.hidden, self.inter, gate_up.numerics, act)
            self.segments = None
        else:
            self._rows_limit = PREFILL_ROWS
            self.segments = (gate_up.block_segments, down.block_segments)
            self._mlp = cpu_blocks.BlockMLP(*self.segments, self.hidden, self.inter,
                                            gate_up.numerics, act)
        self._lora: cpu_lora.MlpDeltas | None = None  # attach_lora

    @staticmethod
    def applies(gate_up: nn.Module, down: nn.Module) -> bool:
        """Both layers packed by one library, or both raw-block segments (of one numerics)."""
        if not (all(isinstance(m, QuantLinear) for m in (gate_up, down))
                and gate_up.out_features == 2 * down.in_features
                and gate_up.in_features == down.out_features
                and gate_up.numerics == down.numerics):
            return False
        if gate_up.packed_weight is not None and down.packed_weight is not None:
            return cpu_quant.fuses(gate_up.parts[0].type_id, down.parts[0].type_id)
        return gate_up.block_segments is not None and down.block_segments is not None

    def attach_lora(self, gate_up: SlotWeights, down: SlotWeights) -> None:
        """The adapters' slots of this MLP's gate_up and down (engine/run/lora): a step's
        rows with an adapter get their deltas inside the one call, gate_up's before the
        activation."""
        if not (gate_up.runs_in_c() and down.runs_in_c()):
            raise ValueError("the one-call MLP adds LoRA deltas from float32 CPU slots only")
        self._lora = cpu_lora.MlpDeltas(gate_up, down)

    def fits(self, x: torch.Tensor, lora: LoraBatch | None = None) -> bool:
        """x's rows fit the one call; with a step's LoRA rows, once the slots are attached
        and where the C kernels add the deltas (LoraBatch.runs_in_c)."""
        return (x.dtype == torch.float32 and x.is_contiguous()
                and 0 < x.numel() <= self._rows_limit * self.hidden
                and (lora is None or (self._lora is not None
                                      and lora.runs_in_c(x.numel() // self.hidden))))

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        out = torch.empty_like(x)
        deltas = None if lora is None else self._lora.address(lora.row_slots)
        self._mlp(x.view(-1, self.hidden), out.view(-1, self.hidden), deltas)
        return out


class QuantEmbedding(nn.Module):
    """Embedding rows gathered from blocks and expanded to float32 per lookup."""

    def __init__(self, weight: QuantWeight, tiles: TileStore | None = None) -> None:
        super().__init__()
        if weight.type_id is None:
            raise ValueError("QuantEmbedding needs a quantized weight")
        self.weight_q = weight.pack(tiles)
        self.num_embeddings, self.embedding_dim = weight.rows, weight.cols

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight_q.rows_f32(ids=ids.reshape(-1))
        return rows.view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, "
                f"type={cpu_quant.TYPE_NAMES[self.weight_q.type_id]}")


def install_quantized(model: nn.Module, weights: dict[str, QuantWeight], numerics: str,
                      biases: dict[str, torch.Tensor] | None = None,
                      tiles: TileStore | None = None) -> set[str]:
    """Replace `model`'s layers whose weights are all in `weights` (HF names); returns the
    names used, which the caller must not load again. A layer with only some of its parts
    quantized gets the rest as dense float32 segments (`weights` holds those too, type None).
    Packed tiles come from one TileStore per call, the model's: `tiles`, else a new one (a
    WeightArena's huge pages, no file)."""
    biases = biases or {}
    tiles = tiles or TileStore()
    groups: dict[str, dict[int, str]] = {}
    for hf_name in weights:
        name = hf_name.removeprefix("model.")
        if name == "embed_tokens.weight" or name == "lm_head.weight":
            continue
        target, shard = model._target(name)
        groups.setdefault(target, {})[0 if shard is None else shard] = hf_name
    used: set[str] = set()
    modules = dict(model.named_modules())
    for target, shards in groups.items():
        path = target.removesuffix(".weight")
        module = modules.get(path)
        if type(module) is not nn.Linear:
            raise KeyError(f"no linear layer {path!r} for quantized weight {shards}")
        parts = [weights[shards[i]] for i in sorted(shards)]
        if (sum(p.rows for p in parts) != module.out_features
                or all(p.type_id is None for p in parts)):
            continue  # NOTE: not every part present, or nothing quantized: loaded densely
        bias = None
        if module.bias is not None:
            names = [shards[i].replace(".weight", ".bias") for i in sorted(shards)]
            if not all(n in biases for n in names):
                raise KeyError(f"biases of {path!r} missing from the checkpoint")
            bias = torch.cat([biases[n] for n in names])
            used.update(names)
        _set_module(model, path, QuantLinear(parts, bias, numerics, tiles))
        used.update(shards.values())
    embed = weights.get("model.embed_tokens.weight")
    if embed is not None and embed.type_id is not None:
        model.embed_tokens = QuantEmbedding(embed, tiles)
        used.add("model.embed_tokens.weight")
        if getattr(model, "lm_head", None) is None:  # NOTE: tied: the same (packed) blocks
            model.lm_head = QuantLinear([model.embed_tokens.weight_q], None, numerics)
    head = weights.get("lm_head.weight")
    if head is not None and head.type_id is not None and model.lm_head is not None:
        model.lm_head = QuantLinear([head], None, numerics, tiles)
        used.add("lm_head.weight")
    return used


def count_weights(model: nn.Module) -> int:
    """Parameters plus the weights held in quantized layers (a tied head's counted once)."""
    seen: set[int] = set()
    total = sum(p.numel() for p in model.parameters())
    for m in model.modules():
        parts = m.parts if isinstance(m, QuantLinear) else (
            [m.weight_q] if isinstance(m, QuantEmbedding) else [])
        for p in parts:
            if id(p) not in seen:
                seen.add(id(p))
                total += p.rows * p.cols
    return total


def _set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)


def quantize_q8_0(weight: torch.Tensor) -> QuantWeight:
    """A dense [rows, cols] weight as Q8_0 blocks (the `gguf` package's quantizer, which is
    ggml's reference rounding); cols must be a multiple of 32."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import quantize

    rows, cols = weight.shape
    if cols % 32:
        raise ValueError(f"int8 quantization needs widths that are multiples of 32, not {cols}")
    blocks = quantize(weight.detach().float().cpu().numpy(), GGMLQuantizationType.Q8_0)
    return QuantWeight(torch.from_numpy(np.ascontiguousarray(blocks)), Q8_0, rows, cols)


def quantize_dense_model(model: nn.Module, numerics: str) -> int:
    """`--quantization int8`: every plain nn.Linear and the embedding (and so a tied head) of
    a loaded dense model become Q8_0 layers; returns the number of layers replaced."""
    count, tiles = 0, TileStore()
    for path, module in list(model.named_modules()):
        if type(module) is nn.Linear and module.in_features % 32 == 0:
            bias = None if module.bias is None else module.bias.detach()
            _set_module(model, path,
                        QuantLinear([quantize_q8_0(module.weight)], bias, numerics, tiles))
            count += 1
    embed = getattr(model, "embed_tokens", None)
    if type(embed) is nn.Embedding and embed.embedding_dim % 32 == 0:
        model.embed_tokens = QuantEmbedding(quantize_q8_0(embed.weight), tiles)
        if getattr(model, "lm_head", None) is None:
            model.lm_head = QuantLinear([model.embed_tokens.weight_q], None, numerics)
        count += 1
    return count
