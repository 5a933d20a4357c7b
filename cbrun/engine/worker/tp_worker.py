"""A tensor-parallel rank above 0: its shard of the model, its slice of the KV cache, and the loop that executes
rank 0's plans (``cbrun.engine.worker.tp_group``). It has no scheduler and samples nothing: rank 0 does both."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from cbrun.engine.config import EngineConfig
from cbrun.engine.core.cache_sizing import resolve_num_blocks
from cbrun.engine.core.kv_layout import KVLayout
from cbrun.engine.model import loader
from cbrun.engine.model.model_impl import select_lean_model
from cbrun.engine.model.safetensors_loader import LeanModel
from cbrun.engine.worker import backends, tp_group
from cbrun.engine.worker.kv_cache import KVCache
from cbrun.engine.worker.model_runner import ModelRunner
from cbrun.engine.worker.threads import resolve_attention_threads
from cbrun.engine.worker.tp_group import TensorParallelError, TensorParallelGroup


def local_cache_shape(model: LeanModel, group: TensorParallelGroup, page_size: int) -> tuple[int, int, int]:
    """(KV heads this rank holds, head_dim, bytes per block of its KV-cache slice) of a sharded ``LeanModel``."""
    assert model.weights.parallel is not None, "the model is not sharded"
    num_kv_heads = model.weights.parallel.layout.local_kv_heads
    head_dim = model.weights.head_dim
    layout = KVLayout.from_model_config(model.config)
    dtype = next(model.parameters()).dtype
    return (
        num_kv_heads,
        head_dim,
        KVCache.bytes_per_block(len(layout.layer_types), page_size, num_kv_heads, head_dim, dtype),
    )


def serve(group: TensorParallelGroup, model_path: str, config: EngineConfig) -> None:
    """Load this rank's shard, agree the KV-cache size with rank 0, then execute each plan rank 0 broadcasts until
    it sends None.

    Raises:
        TensorParallelError: rank 0 failed or went away.
        ValueError / OSError: loading failed (reported to rank 0 by the caller).
    """
    plan = loader.tensor_parallel_plan(model_path, config)
    model = loader.load_model(model_path, config, group.shard(plan.config))
    max_model_len = loader.model_max_len(model.config)
    num_kv_heads, head_dim, bytes_per_block = local_cache_shape(model, group, config.limits.page_size)
    num_blocks = resolve_num_blocks(config, max_model_len, bytes_per_block * group.ranks_per_memory, model.config)
    group.agree_num_blocks(num_blocks)
    spec = group.share_cache_spec(None)
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    kv_cache = KVCache(spec, num_kv_heads, head_dim, dtype, device, num_zeroed_pages=0)
    use_triton = backends.use_triton(config)
    runner = ModelRunner(
        model,
        kv_cache,
        use_triton=use_triton,
        use_cpu_kernel=backends.use_cpu_kernel(config, dtype, use_triton),
        cpu_kernel_threads=resolve_attention_threads(config.num_threads, config.device),
        max_model_len=max_model_len,
        lean_model=select_lean_model(config.model_impl, model, False, max_model_len, config.linear_backend),
        max_requests=config.limits.max_requests_per_batch,
        max_batch_tokens=config.limits.max_batch_tokens,
    )
    with torch.inference_mode():
        while (message := group.recv_step()) is not None:
            step_plan, num_zeroed_pages = message
            kv_cache.zero_pages_below(num_zeroed_pages)
            runner.launch(step_plan)  # the same collectives as rank 0's launch; the logits stay here


def rank_main() -> None:
    """A rank > 0's process (``python -m cbrun.engine.worker.tp_worker`` in torchrun's environment, started by
    ``cbrun.engine.worker.tp_group.start``): join the group, load its shard, execute rank 0's plans until it closes
    the group, exit."""
    store, rank, size, model_path, config = tp_group.connect()
    try:
        serve(tp_group.join(store, rank, size, config), model_path, config)
    except TensorParallelError:
        os._exit(1)  # rank 0 is gone or failed: it reports the fault
    except BaseException as exc:
        tp_group.report_error(store, rank, exc)
        os._exit(1)
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    from cbrun.engine.worker.tp_worker import rank_main as _main  # the module by its own name, not as __main__

    _main()
