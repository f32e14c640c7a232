"""The CPU math library: one C library (kernels/cpu/csrc/, loaded by library.py) behind small
wrappers: ops (norms, rope, argmax), quant (GGUF-quantized products), fused (a decode step's
decoder stack); the attention side's `cpu` backend calls its decode attention.
"""
