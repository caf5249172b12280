"""Triton kernels (FP4 quantize/dequantize, block gather/scatter), installed as engram.kernels."""
