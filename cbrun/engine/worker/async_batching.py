"""Async batching: the host plans and uploads step N+1 while the device computes step N.

The engine keeps one step in flight. After launching step N it advances the scheduler as if N's sampled tokens
were known (each sampling request gets one *pending* token), plans step N+1, launches it, and only then reads N's
tokens back. A decode of N+1 whose input is a token of N takes it straight from N's device tensor of sampled
tokens (``StepHandle.sampled``), so the host never waits for it; the scheduler runs a request with a pending token
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
from dataclasses import dataclass, field

import torch

from cbrun.engine.switches import resolve_switch

logger = logging.getLogger("cbrun.engine")


@dataclass
class StepHandle:
    """A launched step whose results may still be on the device.

    Attributes:
        logits: (N, vocab_size) logits in plan order (prompt log-probability rows, then the sample row, per entry);
            a private copy when the step was launched behind another, so the next replay cannot overwrite it.
        sampled: (S,) int64 on the device, the argmax of each sampling entry's row, in plan order. It is the
            sampled token of every plain-greedy request; rows needing host-side sampling are redone on the host.
        sample_row_of: ``Request.index -> row`` of ``sampled`` (its first: ``RowLayout.sample_index_of``).
        launched: the rows the sampler drew at launch (``cbrun.engine.sample.step.LaunchedRows``), or None.
        done: CUDA event recorded after the device-to-host copy of ``sampled`` (None on the CPU).
    """

    logits: torch.Tensor
    sampled: torch.Tensor
    sample_row_of: dict[int, int]
    _sampled_host: torch.Tensor | None = None
    done: torch.cuda.Event | None = None
    launched: object | None = None
    num_tokens: int | None = None
    _token_ids: list[int] | None = field(default=None, repr=False)
    _extra_ids: list[int] = field(default_factory=list, repr=False)

    @classmethod
    def launch_readback(
        cls,
        logits: torch.Tensor,
        sampled: torch.Tensor,
        sample_row_of: dict[int, int],
        readback: torch.Tensor | None = None,
        launched: object | None = None,
        extras: list[torch.Tensor] | None = None,
    ) -> "StepHandle":
        """Start copying ``readback`` (``sampled`` when None) and ``extras`` to the host in one copy, without
        waiting (pinned buffer + event on CUDA).

        Args:
            readback: ``sampled`` with each failed row's id negative, its error code
                (``cbrun.engine.sample.processing.encode_errors``); ``sampled`` is what the next step reads.
            extras: further (n,) int64 device values the step's reader needs (log-probabilities as float64 bit
                patterns, ``float_bits``), appended to the same copy, so the step still waits once.
        """
        readback = sampled if readback is None else readback
        num_tokens = readback.shape[0]
        if extras:
            readback = torch.cat([readback, *extras])
        if sampled.device.type != "cuda":
            return cls(logits, sampled, sample_row_of, readback, launched=launched, num_tokens=num_tokens)
        host = torch.empty(readback.shape, dtype=readback.dtype, pin_memory=True)
        host.copy_(readback, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return cls(logits, sampled, sample_row_of, host, done, launched=launched, num_tokens=num_tokens)

    def token_ids(self) -> list[int]:
        """The read-back ids in plan order (a row failed by the sampler negative); waits for the step (and its
        copy) to finish. This is the step's one read: the extras come with it (``extra_ids``)."""
        if self._token_ids is None:
            if self.done is not None:
                self.done.synchronize()
            assert self._sampled_host is not None  # ``launch_readback`` always sets it
            values = self._sampled_host.tolist()
            n = len(values) if self.num_tokens is None else self.num_tokens
            self._token_ids, self._extra_ids = values[:n], values[n:]
        return self._token_ids

    def extra_ids(self) -> list[int]:
        """The ``extras`` of ``launch_readback``, concatenated, as host int64 values (read with the tokens)."""
        self.token_ids()
        return self._extra_ids


def float_bits(values: torch.Tensor) -> torch.Tensor:
    """(numel,) int64 on ``values``' device: ``values`` as float64 (exact for float32 and for integers below
    2**53), flattened, their bit patterns reinterpreted, so they ride in the step's int64 read-back."""
    return values.to(torch.float64).reshape(-1).view(torch.int64)


def floats_of(bits: list[int]) -> list[float]:
    """The float64 values of ``float_bits`` patterns read back to the host (no device involved)."""
    return torch.tensor(bits, dtype=torch.int64).view(torch.float64).tolist() if bits else []


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
