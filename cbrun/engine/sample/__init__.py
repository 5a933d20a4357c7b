"""Batched sampling on the logits' device: settings as tensors, processing, filters, the random stream."""
