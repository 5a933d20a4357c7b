"""The KV-cache tensors: the device pages every layer reads and writes, and the CPU swap buffer."""

from __future__ import annotations

import torch

from cbrun.engine.core.cache_spec import CacheSpec


def kv_cache_dtype(setting: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's storage dtype for ``EngineConfig.kv_cache_dtype``: the model's for "auto", else float8_e4m3fn."""
    return model_dtype if setting == "auto" else torch.float8_e4m3fn


class KVCache:
    """The paged KV cache and its CPU swap buffer, in pages of one layer's ``page_size`` tokens.

    ``kv`` has shape (2, spec.num_pages, spec.page_size, num_kv_heads, head_dim): K then V, every layer's pages in
    one pool (which page serves which layer is the block manager's business). ``cpu_kv`` is the same with
    ``spec.num_cpu_pages`` (pinned on CUDA), so an offload or restore is one gather and one copy.

    The pool is allocated, not filled: only the first ``num_zeroed_pages`` (the padding pages) are zeroed at once,
    the others by ``zero_pages_below`` as the block manager first hands them out, so memory the job never uses is
    never touched (on the CPU it is then never resident). Attention reads whole pages and masks the positions past
    a request's context, which must hold finite values; a page once zeroed only ever holds K/V after that. Swap
    slots are written whole before they are read and are not zeroed.

    Args:
        spec: the cache's geometry.
        num_kv_heads, head_dim: the model's K/V shape per token and layer.
        dtype: the cache's dtype: the model's, or float8_e4m3fn for ``kv_cache_dtype = "fp8_e4m3"`` (the
            attention reference quantizes on write and dequantizes on read: ``cbrun.kernels.reference``).
        device: where ``kv`` lives.
        num_zeroed_pages: pages zeroed at once (None: all of them).
    """

    def __init__(
        self,
        spec: CacheSpec,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        num_zeroed_pages: int | None = None,
    ) -> None:
        self.spec = spec
        self.kv = torch.empty((2, spec.num_pages, spec.page_size, num_kv_heads, head_dim), dtype=dtype, device=device)
        self._k_pages, self._v_pages = self.kv[0], self.kv[1]  # ``kv`` is only ever written in place
        self.num_zeroed_pages = 0
        self.zero_pages_below(spec.num_pages if num_zeroed_pages is None else num_zeroed_pages)
        pin = torch.device(device).type == "cuda"
        cpu_shape = (2, spec.num_cpu_pages, spec.page_size, num_kv_heads, head_dim)
        self.cpu_kv = torch.empty(cpu_shape, dtype=dtype, pin_memory=pin) if spec.num_cpu_pages else None

    def zero_pages_below(self, num_pages: int) -> None:
        """Zero pages ``[num_zeroed_pages, num_pages)`` of K and V, so every page below ``num_pages`` is initialised."""
        if num_pages > self.num_zeroed_pages:
            self.kv[:, self.num_zeroed_pages : num_pages].zero_()
            self.num_zeroed_pages = num_pages

    @property
    def k_pages(self) -> torch.Tensor:
        """(num_pages, page_size, num_kv_heads, head_dim) K pages: a view of ``kv``, made once (read every step)."""
        return self._k_pages

    @property
    def v_pages(self) -> torch.Tensor:
        """The V pages, as ``k_pages``."""
        return self._v_pages

    @staticmethod
    def bytes_per_block(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """K and V bytes of ``page_size`` tokens across all layers."""
        return 2 * num_layers * page_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Copy ``(device page, CPU slot)`` pairs out, then ``(CPU slot, device page)`` pairs in.

        A swap-out is complete when this returns: the pages' bytes are in ``cpu_kv`` (the block manager may hand
        the device pages to another request at once). A swap-in is ordered on the current stream before any later
        kernel that reads the pages.
        """
        if not (swap_out or swap_in):
            return
        cpu_kv = self.cpu_kv
        assert cpu_kv is not None, "a swap without CPU offload space"
        if swap_out:
            src, dst = zip(*swap_out)
            cpu_kv[:, list(dst)] = device_to_host(self.kv[:, list(src)])
        if swap_in:
            src, dst = zip(*swap_in)
            self.kv[:, list(dst)] = cpu_kv[:, list(src)].to(self.kv.device, non_blocking=True)


def device_to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of ``tensor`` (a fresh gather, so the CPU returns it as is), complete when returned.

    On CUDA the copy goes into pinned memory without blocking the stream's other work, and the host waits on an
    event recorded after it before anyone reads the result. NOTE: reading the result of a non-blocking
    device-to-host copy before it completes reads whatever the buffer held (the race this avoids).
    """
    if not tensor.is_cuda:
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(tensor.device))
    done.synchronize()
    return host
