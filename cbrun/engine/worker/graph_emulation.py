"""CUDA graphs emulated on any device (``engine.cuda_graphs = "emulate"``): capture records the device work of a
region, replay re-executes exactly that work over the same tensors.

A real CUDA graph keeps the kernels launched during capture, with their arguments: the same addresses, shapes and
Python values. Replaying it reads whatever those addresses hold now and writes the same outputs; anything the
host computed during capture (a shape, a Python number, a tensor made outside the captured region) is frozen.
``EmulatedGraph`` does the same with a ``TorchDispatchMode`` (PyTorch's ``torch.utils._python_dispatch``): every
op dispatched in the region is recorded with its arguments, the very tensor objects, and replay calls it again:

- an op that writes its arguments in place (schema ``Tensor(a!)``) is re-run as it was;
- an op that returns new tensors is re-run and its results copied into the tensors it returned at capture, the
  addresses the ops after it were recorded reading (a graph's memory pool does the same);
- a view (an output in an input's storage) or an allocation is not re-run: neither is device work, and the
  recorded view already aliases its base;
- an op that hands a tensor's value to the host (``.item()``, ``bool(tensor)``) raises at capture, as stream
  capture fails on a device sync.

Our kernels are dispatched as single ops through ``cbrun.kernels.custom_ops``, so they are recorded too. Replay runs
the ops eagerly, one Python call each: it checks correctness, not speed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

#: Ops that allocate without computing: a graph replays nothing for them.
_ALLOCATIONS = frozenset(
    {
        torch.ops.aten.empty.memory_format,
        torch.ops.aten.empty_like.default,
        torch.ops.aten.empty_strided.default,
        torch.ops.aten.new_empty.default,
        torch.ops.aten.new_empty_strided.default,
    }
)


@dataclass
class _RecordedOp:
    """One dispatched op: what to call again, and which of its outputs are fresh tensors to refill (by position
    among its tensor outputs; empty for an op that writes its arguments in place)."""

    func: torch._ops.OpOverload
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    fresh: list[tuple[int, torch.Tensor]]

    def replay(self) -> None:
        result = self.func(*self.args, **self.kwargs)
        if self.fresh:
            outputs = _tensors(result)
            for i, recorded in self.fresh:
                recorded.copy_(outputs[i])


def _tensors(tree: Any) -> list[Any]:
    return [o for o in tree_flatten(tree)[0] if o is not None]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _mutates(func: torch._ops.OpOverload) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)


class _Recorder(TorchDispatchMode):
    """Records the ops dispatched while it is active (the mode is off inside each op, so a custom op's own
    internals are not recorded).

    Args:
        static: storages (``_storage``) the region may read besides what it makes itself; None checks nothing.
    """

    def __init__(self, static: set[int] | None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # NOTE: torch's TorchDispatchMode.__init__ is unannotated
        self.ops: list[_RecordedOp] = []
        self.static = static
        self.made: set[int] = set()  # storages of tensors the region made
        self.foreign: list[str] = []  # ops that read a tensor made outside the region, not static

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: object,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        inputs = [t for t in _tensors((args, kwargs)) if isinstance(t, torch.Tensor)]
        if (
            self.static is not None
            and func is not torch.ops.aten.lift_fresh.default
            and any(t.numel() and _storage(t) not in self.made and _storage(t) not in self.static for t in inputs)
        ):
            self.foreign.append(str(func))
        result = func(*args, **kwargs)
        outputs = _tensors(result)
        self.made.update(_storage(o) for o in outputs if isinstance(o, torch.Tensor))
        if any(not isinstance(o, torch.Tensor) for o in outputs):
            raise RuntimeError(
                f"the captured region reads a tensor's value on the host ({func}): a CUDA graph "
                "cannot capture a device sync; its replay would keep the capture step's value"
            )
        if _mutates(func):
            self.ops.append(_RecordedOp(func, args, kwargs, []))
        elif func not in _ALLOCATIONS:
            # NOTE: by storage, not by schema: ``aten.to`` is annotated as a possible alias but copies when the
            # dtype changes, and a view aliases its input whatever its schema says.
            input_storages = {_storage(t) for t in inputs}
            fresh = [(i, o) for i, o in enumerate(outputs) if _storage(o) not in input_storages]
            if fresh:
                self.ops.append(_RecordedOp(func, args, kwargs, fresh))
        return result


class EmulatedGraph:
    """A recorded region, replayed op by op (``torch.cuda.CUDAGraph``'s ``capture``/``replay`` contract).

    It owns the recorded ops and, through them, every tensor the region made: like a graph's private memory
    pool, they stay allocated and are rewritten by each replay.
    """

    def __init__(self) -> None:
        self._ops: list[_RecordedOp] | None = None

    @property
    def num_ops(self) -> int:
        """Ops recorded (0 before capture)."""
        return len(self._ops or ())

    @contextmanager
    def capture(self, static: list[torch.Tensor] | None = None) -> Iterator[EmulatedGraph]:
        """Record the ops run inside the ``with`` block. Unlike under stream capture they also run; that is
        harmless, since the replay that follows computes the same values again.

        Args:
            static: the tensors a replay may read besides those the region makes (static input buffers, weights,
                the KV cache), or their views. None skips the check.

        Raises:
            RuntimeError: when the region reads a tensor's value on the host, or, with ``static``, reads a tensor
                that it did not make and that is not static (computed outside the capture: its replay would
                keep reading the capture step's values).
        """
        assert self._ops is None, "a graph is captured once"
        recorder = _Recorder(None if static is None else {_storage(t) for t in static})
        with recorder:
            yield self
        if recorder.foreign:
            raise RuntimeError(
                f"the captured region reads tensors computed outside it, neither static buffers nor "
                f"weights nor the cache (first in {recorder.foreign[0]}, {len(recorder.foreign)} "
                "ops in all): every replay would read the capture step's values"
            )
        self._ops = recorder.ops

    def replay(self) -> None:
        """Re-run the recorded ops in order over the recorded tensors."""
        assert self._ops is not None, "replay before capture"
        for op in self._ops:
            op.replay()
