"""Quantized weight formats of the lean path: ``schemes`` (which checkpoint layouts run, the refusal of the rest),
``base`` (the quantized-weight type and the chunked dequantizing GEMM), ``fp8`` and ``int4`` (the two formats),
``shards`` (a tensor-parallel rank's part of each stored tensor)."""
