"""The GGML quantized block types the CPU library reads: ids, block sizes and names.

The Python side of kernels/cpu/csrc/common.h's GGML_TYPES table (a test keeps the two, and
the `gguf` package's GGML_QUANT_SIZES, equal). Ids are gguf.GGMLQuantizationType's.
"""

from __future__ import annotations

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14

# ggml type id -> (weights per block, bytes per block)
BLOCKS = {Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34),
          Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}
TYPE_NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0",
              Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K"}
PACKED_TYPES = (Q4_0, Q4_1, Q8_0)  # the types kernels/cpu/quant.py's `pack` repacks
