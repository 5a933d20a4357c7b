"""Async batching: the host plans and uploads step N+1 while the device computes step N.

The engine keeps one step in flight. After launching step N it advances the scheduler as if N's sampled tokens
were known (each sampling request gets one *pending* token), plans step N+1, launches it, and only then reads N's
tokens back. A decode of N+1 whose input is a token of N takes it straight from N's device tensor of sampled
tokens (``cbrun.engine.sample.step.StepHandle.sampled``), so the host never waits for it; the scheduler runs a request with a pending token
only when that is possible (a plain argmax, not its last token). A request found finished when N is read may
already be in N+1: that extra token is dropped. The idea is vLLM v1's async scheduling and transformers'
continuous batching ``ContinuousBatchingAsyncIOs``; the code is ours.

On CUDA the inputs travel through two I/O buffer pairs (pinned host + device staging, used alternately) on a copy
stream, so the upload of N+1 overlaps the compute of N; stable tensor addresses come from the CUDA graphs, which
async batching therefore requires. On the CPU there is no stream to overlap with: async batching is off there
(``LLMEngine.overlap_steps`` still runs the same bookkeeping synchronously, which is how the CPU tests check it).
"""

from __future__ import annotations

import logging

import torch

from cbrun.engine.switches import resolve_switch

logger = logging.getLogger("cbrun.engine")


class InputStager:
    """Two I/O buffer pairs and a copy stream: step inputs go host -> pinned -> device while the device computes.

    ``stage`` packs the step's int64/int32 host tensors into pinned buffer ``k`` (the pair alternates each step),
    copies it to device buffer ``k`` on the copy stream, and makes the compute stream wait for that copy. A pair is
    reused two steps later, after the copy that last filled it has finished (host side) and the compute stream has
    consumed its device half (device side).

    Args:
        capacity: int64 elements a step's inputs may need at most.
        device: the CUDA device.

    Raises:
        ValueError: from ``stage`` when the inputs exceed ``capacity``.
    """

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.capacity = capacity
        self.host = [torch.empty(capacity, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self.device = [torch.empty(capacity, dtype=torch.int64, device=device) for _ in range(2)]
        self.copied = [torch.cuda.Event() for _ in range(2)]
        self.consumed = [torch.cuda.Event() for _ in range(2)]
        self.copy_stream = torch.cuda.Stream(device=device)
        self._next = 0

    def stage(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Device copies of ``tensors`` (same shapes and dtypes), ordered before later compute-stream work."""
        total = sum(t.numel() for t in tensors)
        if total > self.capacity:
            raise ValueError(f"step inputs need {total} int64 elements; the staging buffers hold {self.capacity}")
        k, self._next = self._next, 1 - self._next
        self.copied[k].synchronize()  # the host half is free once its last upload finished
        host = self.host[k]
        offset = 0
        for t in tensors:
            host[offset : offset + t.numel()].copy_(t.reshape(-1))
            offset += t.numel()
        compute = torch.cuda.current_stream()
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self.consumed[k])  # the device half is free once compute read it
            self.device[k][:total].copy_(host[:total], non_blocking=True)
            self.copied[k].record()
        compute.wait_event(self.copied[k])
        out, offset = [], 0
        for t in tensors:
            # A private copy on the compute stream, so the pair is free as soon as these copies ran.
            out.append(self.device[k][offset : offset + t.numel()].view(t.shape).to(t.dtype, copy=True))
            offset += t.numel()
        self.consumed[k].record(compute)
        return out


def use_async_batching(setting: str, device: str, use_cuda_graphs: bool, speculative: str = "off") -> bool:
    """Whether to overlap steps; logs once why not, or raises when ``setting`` is "on" and it cannot.

    Speculative decoding and async batching are one choice, made here: with a step in flight a request's last
    token is still on the device when its next step is planned, so a proposer, which reads the request's known
    tokens, has nothing to propose from, and verify steps never run (on a CPU stand-in, 29 verify entries with
    async off and 0 with it on for the same n-gram workload, ``tests/engine/test_async_batching.py``). With
    ``speculative`` set, "auto" turns async batching off and says so; "on" is refused
    (``backends.check_speculative``).

    Args:
        setting: ``EngineConfig.async_batching``: "auto", "on" or "off".
        device: the engine's device string.
        use_cuda_graphs: whether the forward pass replays CUDA graphs.
        speculative: ``EngineConfig.speculative``.

    Raises:
        ValueError: for "on" on a non-CUDA device or without CUDA graphs.
    """
    reason = None
    if torch.device(device).type != "cuda":
        reason = f"the device is {device}, not CUDA: no stream to overlap with"
    elif not use_cuda_graphs:
        reason = "it needs CUDA graphs (stable input addresses), which are off"
    elif speculative != "off":
        reason = (
            f"speculative = {speculative!r} proposes from the tokens known on the host, and with a step in flight "
            "a request's last token never is: speculation is chosen"
        )
    return resolve_switch("async_batching", setting, reason, off_log="async batching off: %s")
