"""Why a tensor-parallel Ray replica is one actor reserving its ranks' GPUs, not a placement group of one-GPU
bundles (docs/running.md, "Tensor-parallel replicas"): on a local Ray with 4 fake GPUs, two replica actors with
``replica_resources``' reservation (the options Ray Data's actor pool gives them) each get 2 GPUs of their own in
``CUDA_VISIBLE_DEVICES``, and a process a replica starts (its rank 1) sees the same 2; an actor in a placement group
of one-GPU bundles sees one (a GPU bundle of its own) or none of them. Skipped without Ray (the extra cbrun[ray])."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from cbrun.engine.config import EngineConfig
from cbrun.jobs.run.ray_executor import replica_resources

#: What a rank process started by the replica sees.
CHILD = [sys.executable, "-c", "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES'))"]


def _devices() -> tuple[str | None, str]:
    """(the actor's CUDA_VISIBLE_DEVICES, its child process's)."""
    return os.environ.get("CUDA_VISIBLE_DEVICES"), subprocess.run(CHILD, capture_output=True, text=True).stdout.strip()


@pytest.fixture(scope="module")
def ray_with_fake_gpus():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, num_gpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


def test_each_replica_and_its_ranks_see_its_own_gpus(ray_with_fake_gpus):
    ray = ray_with_fake_gpus
    cuda = EngineConfig(tensor_parallel_size=2)
    object.__setattr__(cuda, "device", "cuda:0")  # no CUDA here: only the device name is read
    num_gpus, _, _ = replica_resources(SimpleNamespace(num_gpus_per_replica=None, num_cpus_per_replica=1), cuda)
    assert num_gpus == 2
    # the options Ray Data's actor pool gives each replica actor (``map_batches(num_gpus=...)``)
    replica = ray.remote(num_gpus=num_gpus, num_cpus=0)(_Replica)
    replicas = [replica.remote() for _ in range(2)]
    seen = ray.get([r.devices.remote() for r in replicas])
    for actor, child in seen:
        assert actor == child and len(actor.split(",")) == 2, seen
    assert not set(seen[0][0].split(",")) & set(seen[1][0].split(",")), seen  # each its own pair of the four


class _Replica:
    def devices(self) -> tuple[str | None, str]:
        return _devices()


def test_an_actor_in_a_placement_group_of_one_gpu_bundles_sees_fewer_than_its_ranks_need(ray_with_fake_gpus):
    ray = ray_with_fake_gpus
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    probe = ray.remote(_devices)
    group = placement_group([{"GPU": 1, "CPU": 0.01}] * 2, strategy="STRICT_PACK")
    ray.get(group.ready())
    try:
        seen = {
            num_gpus: ray.get(
                probe.options(
                    num_gpus=num_gpus,
                    num_cpus=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0),
                ).remote()
            )
            for num_gpus in (0, 1)
        }
    finally:
        remove_placement_group(group)
    # as Ray Data LLM's Ray-executor replica (num_gpus 0): no devices of its own
    actor, child = seen[0]
    assert actor in (None, "") and child in ("None", "")
    # one GPU bundle's worth: one device, the other bundle's is for another Ray worker, not a child process
    actor, child = seen[1]
    assert actor == child and len(actor.split(",")) == 1
