"""Which forward pass runs a loaded model (``engine.model_impl``): its family's lean forward pass
(``cbrun.engine.model.registry``) or transformers' own modules."""

from __future__ import annotations

import logging

import torch

from cbrun.engine.model import registry
from cbrun.engine.model.family import LeanForward
from cbrun.engine.model.safetensors_loader import LeanModel
from cbrun.engine.switches import resolve_switch
from cbrun.kernels.batch_invariant import InvariantKernels

logger = logging.getLogger("cbrun.engine")


def select_lean_model(
    model_impl: str,
    model,
    use_cuda_graphs: bool,
    max_model_len: int,
    linear_backend: str = "auto",
    batch_invariant: bool = False,
    invariant_kernels: InvariantKernels | None = None,
    fp8_activation_scheme: str = "none",
) -> LeanForward | None:
    """The lean forward pass when ``model_impl`` asks for it and it applies; None runs transformers' modules.
    A ``LeanModel`` (loaded without transformers) always gets it.

    Logs once (logger "cbrun.engine", INFO) which implementation runs and, under "auto", why not the lean one.

    Raises:
        ValueError: ``model_impl == "lean"`` with an unsupported model or with CUDA graphs on (graphs capture
            transformers' forward pass); ``linear_backend == "onednn"`` where the lean path does not run (the
            transformers modules always use torch's GEMM) or cannot use oneDNN; ``batch_invariant`` or
            ``fp8_activation_scheme = "dynamic"`` where the lean path does not run; from the family's forward pass
            (``fp8_activation_scheme`` over weights W8A8 cannot run).

    ``invariant_kernels``: under ``batch_invariant``, the Triton kernels that run it (Triton attention: CUDA, or
    the CPU under the interpreter; ``cbrun.engine.worker.backends.invariant_kernels``); None for the CPU's own.
    """
    lean = _select_lean_model(
        model_impl,
        model,
        use_cuda_graphs,
        max_model_len,
        linear_backend,
        batch_invariant,
        invariant_kernels,
        fp8_activation_scheme,
    )
    if lean is None:
        _refuse_lean_only_settings(linear_backend, batch_invariant, fp8_activation_scheme)
    return lean


def _refuse_lean_only_settings(linear_backend: str, batch_invariant: bool, fp8_activation_scheme: str) -> None:
    """ValueError naming the first setting that runs only on the lean forward pass, for a model that does not
    use it (transformers' modules would ignore it)."""
    if linear_backend == "onednn":
        raise ValueError(
            "linear_backend = onednn runs only on the lean forward pass, which this model does not "
            "use (see the log); use linear_backend = auto or torch"
        )
    if batch_invariant:
        raise ValueError(
            "batch_invariant = on runs only on the lean forward pass, which this model does not use (see the "
            "log); set engine.batch_invariant = off"
        )
    if fp8_activation_scheme != "none":
        raise ValueError(
            f'fp8_activation_scheme = "{fp8_activation_scheme}" runs only on the lean forward pass, which this model '
            'does not use (see the log); set engine.fp8_activation_scheme = "none"'
        )


def _select_lean_model(
    model_impl: str,
    model: torch.nn.Module,
    use_cuda_graphs: bool,
    max_model_len: int,
    linear_backend: str,
    batch_invariant: bool,
    invariant_kernels: InvariantKernels | None = None,
    fp8_activation_scheme: str = "none",
) -> LeanForward | None:
    if isinstance(model, LeanModel):  # loaded without transformers: the lean pass is its only forward pass
        if model_impl == "transformers" or use_cuda_graphs:
            setting = "model_impl = transformers" if model_impl == "transformers" else "CUDA graphs"
            raise ValueError(
                f"{setting} needs transformers' modules, but the model was loaded without "
                "transformers (engine.safetensors_loader); load it with engine.loader = transformers"
            )
        family = registry.family_of(model.config)
        logger.info("model implementation: lean (%s)", family.architecture)
        return family.forward(
            model.weights, max_model_len, linear_backend, batch_invariant, invariant_kernels, fp8_activation_scheme
        )
    if model_impl == "transformers":
        logger.info("model implementation: transformers (model_impl = transformers)")
        return None
    reason = registry.unsupported_reason(model)
    if reason is None and use_cuda_graphs:
        reason = "CUDA graphs capture transformers' forward pass (set cuda_graphs = off to use the lean path)"
    if not resolve_switch(
        "model_impl",
        model_impl,
        reason,
        on="lean",
        off="transformers",
        off_log="model implementation: transformers (lean path not used: %s)",
        hint="; use model_impl = auto or transformers",
    ):
        return None
    found = registry.family_for_architecture(type(model).__name__)
    assert found is not None  # unsupported_reason found it
    logger.info("model implementation: lean (%s)", found.architecture)
    weights = found.weights_from_module(model)
    return found.forward(
        weights, max_model_len, linear_backend, batch_invariant, invariant_kernels, fp8_activation_scheme
    )
