"""What a model family on the lean path is: the interface each family file in ``cbrun.engine.model.models``
implements, and ``cbrun.engine.model.registry`` lists (vLLM's ``model_executor/models`` plus its registry).

A family owns everything that differs between families: its config keys and transformers' defaults for them (the
transformers-free config reader), its checkpoint's tensor names and shapes, how it reads a transformers module's
own tensors, and its forward pass, composed from the shared layers in ``cbrun.engine.model.layers``. Nothing
outside its file and its registry line names it.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch

from cbrun.engine.model.config import LlamaConfig
from cbrun.engine.model.layers.attention import AttentionMetadata
from cbrun.engine.model.layers.linear import Backend
from cbrun.engine.model.layers.quantization.schemes import QuantScheme
from cbrun.engine.model.weights import LlamaWeights
from cbrun.kernels.batch_invariant import InvariantKernels


class LeanForward(Protocol):
    """A family's forward pass over the engine's paged cache, as the model runner calls it."""

    #: every row's logits are the same bits whatever else is in the step (``engine.batch_invariant``)
    batch_invariant: bool

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata, logits_indices: torch.Tensor
    ) -> torch.Tensor:
        """(T,) int64 ids and positions, the step's metadata, (N,) int64 rows wanted -> (N, vocab) logits."""
        ...


class ModelFamily:
    """One model family of the lean path (subclassed once per family file).

    Attributes:
        model_type: config.json's ``model_type``.
        architecture: the transformers class ``AutoModelForCausalLM`` builds for it (``type(model).__name__``).
        keep_in_float32: see below.
    """

    model_type: ClassVar[str]
    architecture: ClassVar[str]
    #: transformers' ``_keep_in_fp32_modules``: a checkpoint tensor whose name contains one of these stays float32
    #: when the engine loads in float16 (as transformers keeps it), whatever it was stored as.
    keep_in_float32: ClassVar[tuple[str, ...]] = ()

    def parse_config(self, raw: dict) -> tuple[LlamaConfig | None, str | None]:
        """``(config, None)`` for a config.json (as a dict) read exactly as transformers reads it, else
        ``(None, why not)``."""
        raise NotImplementedError

    def unsupported_quantization(self, scheme: QuantScheme | None) -> str | None:
        """Why this family cannot read a checkpoint quantized in ``scheme`` (a layout
        ``cbrun.engine.model.layers.quantization.schemes`` implements), or None."""
        return None

    def checkpoint_shapes(self, config: LlamaConfig) -> dict[str, tuple[int, ...]]:
        """Every tensor name a transformers checkpoint of this config holds, with its shape."""
        raise NotImplementedError

    def checkpoint_weights(
        self, config: LlamaConfig, tensors: dict[str, torch.Tensor], device: str, experts: range | None
    ) -> LlamaWeights:
        """The checkpoint's tensors (by name, as ``checkpoint_shapes`` names them; a tensor-parallel rank's slices)
        as the forward pass reads them; ``experts``: the MoE experts loaded (a rank's), None for all."""
        raise NotImplementedError

    def shard_style(self, name: str) -> str | None:
        """How a tensor-parallel group splits checkpoint tensor ``name`` (one of
        ``cbrun.engine.model.layers.parallel.SPLIT_STYLES``), None where every rank holds it whole."""
        raise NotImplementedError

    def unsupported_parallel_reason(self, config: LlamaConfig) -> str | None:
        """Why tensor parallelism cannot split this family's weights at all (checked before the shapes
        ``cbrun.engine.model.layers.parallel.unsupported_reason`` checks), or None."""
        return None

    def batch_invariant_reason(self, config: LlamaConfig) -> str | None:
        """Why this family's forward pass cannot run ``engine.batch_invariant = on``, or None (a job's "auto" then
        turns it off, saying why: ``cbrun.engine.worker.backends.batch_invariant_blocker_before_load``)."""
        return None

    def unsupported_module_reason(self, model: torch.nn.Module) -> str | None:
        """Why the forward pass cannot run this family's transformers model exactly as transformers does, or None."""
        raise NotImplementedError

    def weights_from_module(self, model: torch.nn.Module) -> LlamaWeights:
        """The tensors of a transformers model ``unsupported_module_reason`` accepts (its own, not copies)."""
        raise NotImplementedError

    def forward(
        self,
        weights: LlamaWeights,
        max_positions: int | None,
        linear_backend: Backend,
        batch_invariant: bool,
        invariant_kernels: InvariantKernels | None = None,
        fp8_activation_scheme: str = "none",
    ) -> LeanForward:
        """The family's forward pass over ``weights`` (arguments as ``cbrun.engine.model.models.llama.LeanLlama``).

        Raises:
            ValueError: naming the setting, when the forward pass cannot run these weights with these settings.
        """
        raise NotImplementedError
