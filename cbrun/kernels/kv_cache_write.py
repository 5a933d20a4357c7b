"""Triton kernel that stores one step's keys and values in the paged KV cache.

Same contract as ``cbrun.kernels.reference.write_kv_cache_ref``: token t goes to flat slot ``slot_mapping[t]`` of
``(num_blocks, page_size, num_kv_heads, head_dim)`` caches, and a negative slot (padding) writes nothing.
One program copies one token's (num_kv_heads, head_dim) key and value tiles.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from cbrun.kernels.paged_attention import LaunchConfig

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)


@triton.jit
def kv_cache_write_kernel(
    key_ptr,  # (T, num_kv_heads, head_dim), strides (stride_key_t, stride_key_h, 1)
    value_ptr,  # (T, num_kv_heads, head_dim), strides (stride_value_t, stride_value_h, 1)
    k_cache_ptr,  # (num_blocks, page_size, num_kv_heads, head_dim), strides (stride_cache_*, 1); shared by v_cache
    v_cache_ptr,  # (num_blocks, page_size, num_kv_heads, head_dim), same strides as k_cache
    slot_mapping_ptr,  # (T,) int32/int64 flat slot per token, < 0 = skip
    num_slots,  # num_blocks * page_size: slots at or past it are skipped too (never written out of bounds)
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,  # next power of two >= NUM_KV_HEADS
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # NOTE: a skipped slot is folded into the mask instead of an early return: same cost, and the interpreter
    # handles it on every version.
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    slots = tl.full([BLOCK_H], 0, tl.int64) + slot  # (BLOCK_H,) the token's slot, broadcast
    heads_ok = (heads < NUM_KV_HEADS) & (slots >= 0) & (slots < num_slots)
    mask = heads_ok[:, None] & (dims[None, :] < HEAD_DIM)  # (BLOCK_H, BLOCK_D)
    slot = tl.maximum(slot, 0)
    block = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE

    key = tl.load(key_ptr + token * stride_key_t + heads[:, None] * stride_key_h + dims[None, :], mask=mask)
    value = tl.load(value_ptr + token * stride_value_t + heads[:, None] * stride_value_h + dims[None, :], mask=mask)
    cache_offsets = (
        block * stride_cache_block + offset * stride_cache_offset + heads[:, None] * stride_cache_head + dims[None, :]
    )
    tl.store(k_cache_ptr + cache_offsets, key, mask=mask)
    tl.store(v_cache_ptr + cache_offsets, value, mask=mask)


def write_kv_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store this step's keys and values in the paged cache, in place (Triton).

    Args:
        key, value: (T, num_kv_heads, head_dim), fp16/bf16/fp32; last dim contiguous (a strided slice of a fused
            QKV projection is fine).
        k_cache, v_cache: (num_blocks, page_size, num_kv_heads, head_dim), same dtype as key/value, identical
            strides, last dim contiguous.
        slot_mapping: (T,) int32/int64 flat slot ``block * page_size + offset`` of each token; a negative slot
            (padding) is skipped. NOTE: a slot >= num_blocks * page_size is skipped as well rather than written out
            of bounds (the reference would raise); checking it here would cost a device sync.

    Raises:
        ValueError: naming the argument whose shape, dtype, stride or device is wrong.
    """
    _check_write_args(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    num_blocks, page_size = k_cache.shape[0], k_cache.shape[1]
    if num_tokens == 0:
        return
    launch = kv_write_launch_config(num_kv_heads, head_dim, page_size)
    strides = (*key.stride()[:2], *value.stride()[:2], *k_cache.stride()[:3])
    tensors = (key, value, k_cache, v_cache, slot_mapping)
    launch.launch(kv_cache_write_kernel, (num_tokens,), *tensors, num_blocks * page_size, *strides)


@functools.lru_cache(maxsize=64)
def kv_write_launch_config(num_kv_heads: int, head_dim: int, page_size: int) -> LaunchConfig:
    """The constexprs and launch options of one ``kv_cache_write_kernel`` launch (``cbrun.kernels.aot_fit`` compiles
    exactly this): one token's (num_kv_heads, head_dim) tile per program, 4 warps once it has 1024 elements."""
    constexprs = dict(
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
    return LaunchConfig(constexprs, 4 if num_kv_heads * head_dim >= 1024 else 1, 2)


def _check_write_args(key, value, k_cache, v_cache, slot_mapping) -> None:
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(
            f"key and value must both be (T, num_kv_heads, head_dim), got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be (num_blocks, page_size, num_kv_heads, head_dim), got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if tuple(k_cache.shape[2:]) != tuple(key.shape[1:]):
        raise ValueError(
            f"cache (num_kv_heads, head_dim) = {tuple(k_cache.shape[2:])} does not match key's {tuple(key.shape[1:])}"
        )
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(
            f"slot_mapping must be ({key.shape[0]},) (one slot per token), got {tuple(slot_mapping.shape)}"
        )
    if key.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"key dtype must be one of {_FLOAT_DTYPES}, got {key.dtype}")
    for name, tensor in (("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        if tensor.dtype != key.dtype:
            raise ValueError(f"{name} dtype {tensor.dtype} differs from key dtype {key.dtype}")
    if slot_mapping.dtype not in _INDEX_DTYPES:
        raise ValueError(f"slot_mapping dtype must be int32 or int64, got {slot_mapping.dtype}")
    for name, tensor in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim (head_dim), got strides {tensor.stride()}")
    if v_cache.stride() != k_cache.stride():
        raise ValueError(
            f"k_cache and v_cache must have identical strides, got {k_cache.stride()} and {v_cache.stride()}"
        )
    if slot_mapping.numel() > 1 and slot_mapping.stride(0) != 1:
        raise ValueError(f"slot_mapping must be contiguous, got stride {slot_mapping.stride()}")
    devices = {t.device for t in (key, value, k_cache, v_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"key, value, k_cache, v_cache and slot_mapping must share one device, got {devices}")
