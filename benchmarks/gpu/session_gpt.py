"""The fake-CUDA rehearsal's Megatron GPT training step on a real device (a part of
``benchmarks/gpu/session.py``; child side).

``tests/fake_cuda/megatron_step.py`` builds a GPT at production shapes (2 layers, hidden 4096,
32/8 heads, FFN 14336, vocab 32000, 128K tokens) with the StarTrail layer spec from StarTrail's
flags, wraps it as ``megatron.training`` does (Float16Module, DDP, the distributed optimizer) and
runs one step through Megatron's schedule as rank 1 of CP ``P``. Here the same
``megatron_step.step_facts`` runs on the real device, rank 1 of torch's fake process group
(communication returns at once), with the Megatron stand-ins the rehearsal keeps for that group
(``megatron_standins.megatron_on_fake_group``: objects gathered as this rank's, bucket
collectives one by one, the grad norm on the device) and the CUDA caching allocator's counters
in place of the rehearsal's ``LiveStorages``. Its peak is set beside the rehearsal's
(``benchmarks/results/fake_cuda_gpt_step.json``: 15.83 GiB at CP8 C2, 10.24 at CP16 C4).

Needs megatron-core (the GPU image has none: ``scripts/gpu_session.sh`` installs the carried
cp312 wheel). The CPU self-check runs the same code at toy shapes on
fake CUDA, as the rehearsal runs it (``LiveStorages`` counting; the shim built by the parent).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import weakref
from pathlib import Path

import torch

from benchmarks import RESULTS

REHEARSAL = Path(RESULTS) / "fake_cuda_gpt_step.json"
NAN = float("nan")
# Allocated before a configuration with no parameter of the last one alive: more is an earlier
# model's storage (CP8 C2's is ~4.9 GiB). Less is what a process keeps once it has run a step, and
# is subtracted from the peak: on the H200 (2026-11-28) 72 MiB stayed after CP8 C2 with all of its
# parameters gone, with cuBLAS's workspaces freed first (a 64 MiB bar stopped CP16 C4 there).
LEFTOVER_BYTES = 512 * 2**20


class AllocatorMemory:
    """``LiveStorages``' interface on the CUDA caching allocator (NaN on the CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    @property
    def live(self) -> float:
        return torch.cuda.memory_allocated() if self.cuda else NAN

    @property
    def peak(self) -> float:
        return torch.cuda.max_memory_allocated() if self.cuda else NAN

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def live_by_op(self) -> dict:
        return {}  # the allocator does not know which op made a block


def rehearsed_peak(cp: int, team: int, seq_length: int) -> float | None:
    if not REHEARSAL.exists():
        return None
    for run in json.loads(REHEARSAL.read_text())["runs"]:
        if (run["cp"], run["team"], run["seq_length"]) == (cp, team, seq_length):
            return run["peak_bytes"]
    return None


def fake_cuda() -> bool:
    """Whether this process runs on the rehearsal's fake CUDA (the shim preloaded, no GPU)."""
    from tests.fake_cuda.rank import shim_loaded  # noqa: PLC0415

    return shim_loaded() and not torch.cuda.is_available()


@contextlib.contextmanager
def rank_and_memory(cp: int, rank: int, device: torch.device):
    """Rank ``rank`` of ``cp`` on torch's fake process group; yields the memory counter: the
    CUDA allocator's on a device, ``LiveStorages`` on fake CUDA (the CPU self-check)."""
    if fake_cuda():
        from tests.fake_cuda.memory import LiveStorages  # noqa: PLC0415
        from tests.fake_cuda.rank import fake_cuda_rank  # noqa: PLC0415

        with fake_cuda_rank(rank, cp, stand_in_values=True), LiveStorages(device_type="cuda") as memory:
            yield memory
    else:
        from benchmarks.gpu.check_rank import fake_rank  # noqa: PLC0415

        with fake_rank(cp, rank):
            yield AllocatorMemory(device)


class Configurations:
    """Weak references to each configuration's parameters, so the next one can check that it
    starts on an empty device: nothing of the last model alive, ``memory_allocated()`` ~ 0 (the
    H100 would otherwise measure CP16 C4's peak with CP8 C2's 4.9 GiB model still allocated)."""

    def __init__(self) -> None:
        self.params: list[weakref.ref] = []

    def watch(self, model) -> None:
        self.params = [weakref.ref(p) for p in model.parameters()]

    def before_next(self, device: torch.device) -> dict:
        """Collects, empties the allocator's cache and says what is left; RuntimeError when the last
        configuration's parameters are alive or more than LEFTOVER_BYTES are allocated."""
        gc.collect()
        cuda = device.type == "cuda" and not fake_cuda()
        if cuda:
            torch.cuda.synchronize()
            if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):  # cuBLAS's per-stream workspaces
                torch._C._cuda_clearCublasWorkspaces()
            torch.cuda.empty_cache()
        left = {"previous_params_alive": sum(ref() is not None for ref in self.params),
                "allocated_at_start": torch.cuda.memory_allocated() if cuda else NAN}
        if left["previous_params_alive"] or left["allocated_at_start"] > LEFTOVER_BYTES:
            raise RuntimeError(f"the last GPT configuration is still held ({left['previous_params_alive']} of its "
                               f"{len(self.params)} parameters alive, {left['allocated_at_start']} bytes allocated): "
                               "its peak would count in this one's")
        return left


def gpt_step(cp: int, team: int, shape: dict, device: torch.device, configurations: Configurations | None = None) -> dict:
    """One training step at ``shape`` (megatron_step's options) as rank 1 of CP ``cp``."""
    from tests.fake_cuda import megatron_step  # noqa: PLC0415 - imports megatron

    configurations = configurations or Configurations()
    start = configurations.before_next(device)
    opts = argparse.Namespace(**{**vars(megatron_step.parse([])), **shape, "cp": cp, "team": team, "rank": 1})
    config = megatron_step.gpt_config(opts)
    with rank_and_memory(cp, opts.rank, device) as memory, megatron_step.used_kernels_and_transports() as used:
        facts = megatron_step.step_facts(opts, config, memory, watch=configurations.watch)
    if device.type == "cuda" and not fake_cuda():
        torch.cuda.synchronize()
    facts.pop("step_marks", None)
    rehearsed = rehearsed_peak(cp, team, opts.seq_length)
    # the step's own peak: what was allocated before it (under LEFTOVER_BYTES) is not its storage
    if start["allocated_at_start"] == start["allocated_at_start"]:  # not NaN (the CPU self-check)
        facts["peak_bytes"] -= start["allocated_at_start"]
    return {**facts, **start, "kernels": sorted(used["kernels"]), "transports": sorted(used["transports"]),
            "rehearsal_peak_bytes": rehearsed, "device": str(device),
            "peak_over_rehearsal": facts["peak_bytes"] / rehearsed if rehearsed else NAN}


def gpt_part(items, configs: list[list[int]], shape: dict, device: str = "cuda:0") -> None:
    """Child side: one item per ``[cp, team]``, on the device, or on fake CUDA where this
    process was started with the shim (the CPU self-check: the rehearsal's stand-ins)."""
    from megatron_startrail.megatron import cpu_patches  # noqa: PLC0415

    cpu_patches.install_import_shims()
    from tests.fake_cuda.megatron_standins import megatron_on_fake_cuda, megatron_on_fake_group  # noqa: PLC0415

    dev = torch.device(device)
    if fake_cuda():
        megatron_on_fake_cuda()
    else:
        torch.cuda.set_device(dev.index or 0)
        megatron_on_fake_group()
    configurations = Configurations()
    items.run(configs, lambda c: [gpt_step(c[0], c[1], shape, dev, configurations)],
              lambda c: f"Megatron GPT step CP{c[0]} C{c[1]} {shape.get('seq_length', 131072)} tokens")
