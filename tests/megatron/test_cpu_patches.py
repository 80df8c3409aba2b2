"""The CPU patches are for CPU-only runs: never applied when CUDA is available."""

import torch

from tests.megatron.utils import Utils, cpu_patches
from tests.multiproc import run_ranks


def test_refuses_to_patch_when_a_gpu_is_present(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    current_device = torch.cuda.current_device
    try:
        cpu_patches.apply()
    except RuntimeError as err:
        assert "CPU-only" in str(err)
    else:
        raise AssertionError("cpu_patches.apply() ran although CUDA is available")
    # nothing was touched
    assert torch.cuda.current_device is current_device and not cpu_patches.is_applied()


def test_the_test_process_itself_is_not_patched():
    # Only forked ranks (Utils.initialize_model_parallel) patch; the pytest parent stays clean.
    assert not cpu_patches.is_applied()


def test_cuda_allocations_land_on_the_cpu():
    with cpu_patches.CudaToCpuMode():
        made = [
            torch.zeros(3, device="cuda"),
            torch.arange(4, device=torch.device("cuda", 0)),
            torch.ones(2).cuda(),
            torch.ones(2).to("cuda"),
            torch.empty(2, pin_memory=True),
        ]
    assert all(t.device.type == "cpu" for t in made)


def patched_worker(rank, world_size):
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    Utils.initialize_model_parallel(seed=1234)  # applies the patches, seeds the tracker
    cpu_patches.apply()  # idempotent
    default_before = torch.get_rng_state()
    with get_cuda_rng_tracker().fork():
        first = torch.rand(4)
    with get_cuda_rng_tracker().fork():
        second = torch.rand(4)
    outside = torch.rand(4)
    torch.cuda.synchronize()
    Utils.destroy_model_parallel()
    return cpu_patches.is_applied(), torch.cuda.current_device(), first, second, outside, default_before


def test_patched_process_has_a_working_model_parallel_rng():
    ((applied, device, first, second, outside, default_before),) = run_ranks(patched_worker, 1, timeout=60)
    assert applied and device == 0
    # What the patched tracker must do, written from Megatron's definitions and torch alone
    # (three consecutive draws differ anyway, so comparing them with each other would pass
    # with a fork that did nothing). model_parallel_cuda_manual_seed seeds the
    # tensor-model-parallel state with seed + 2718 + tp_rank (1234 + 2718 + 0 here), so:
    tracker_stream = torch.Generator().manual_seed(1234 + 2718)
    # 1. inside a fork the draws come from that seed, not from the default generator;
    assert torch.equal(first, torch.rand(4, generator=tracker_stream))
    # 2. the next fork continues the tracker's stream where the first one left it;
    assert torch.equal(second, torch.rand(4, generator=tracker_stream))
    # 3. leaving a fork restores the default generator: outside the forks it draws as if
    #    they had never run.
    default_stream = torch.Generator()
    default_stream.set_state(default_before)
    assert torch.equal(outside, torch.rand(4, generator=default_stream))
