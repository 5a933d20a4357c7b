"""The shared layer library the lean-path families compose their forward passes from (nano-vllm's ``layers/``):
``linear`` (a projection and its GEMM: torch's, oneDNN's, batch-invariant, quantized), ``layernorm``,
``activation``, ``rotary_embedding``, ``embed_head`` (the token embedding and the LM head), ``attention`` (the
paged attention call, ``AttentionMetadata``, the transformers hook) with ``attention_contract``, ``moe`` (the
sparse MoE block), ``parallel`` (tensor-parallel shards and collectives) and ``quantization/`` (the quantized
weight formats)."""
