"""The CPU patches are for CPU-only runs: never applied when CUDA is available. Their import
shims let megatron.core / megatron.training import without triton, for the installed
megatron-core and (with MEGATRON_LM_MAIN pointing at a Megatron-LM checkout, e.g. main at
d98e8a64) for a Megatron-LM tree on PYTHONPATH."""

import os
import subprocess
import sys

import pytest
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


def moe_and_sequence_parallel_worker(rank, world_size):
    from megatron.core.transformer.moe import token_dispatcher
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    cpu_patches.apply()
    norms = {}
    for sequence_parallel in (False, True):
        config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, use_cpu_initialization=True,
                                   tensor_model_parallel_size=2,  # what SP needs; no group is used
                                   sequence_parallel=sequence_parallel, normalization="RMSNorm")
        norm = WrappedTorchNorm(config, 8, eps=1e-6)
        x = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(0))
        norms[sequence_parallel] = (type(norm).__name__, norm.eps,
                                    [getattr(p, "sequence_parallel", False) for p in norm.parameters()], norm(x))
    splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 5]), as_numpy=True)
    return norms, type(splits).__name__, list(splits)


def test_sequence_parallel_norm_and_moe_split_sizes_on_the_cpu():
    """--sequence-parallel: the same torch norm, its weight marked for the TP-group gradient sum
    (finalize_model_grads); the all-to-all dispatcher's split sizes become host arrays."""
    ((norms, splits_type, splits),) = run_ranks(moe_and_sequence_parallel_worker, 1, timeout=60)
    plain, sp = norms[False], norms[True]
    assert plain[:2] == sp[:2] == ("RMSNorm", 1e-6)
    assert plain[2] == [False] and sp[2] == [True]
    assert torch.equal(plain[3], sp[3])
    assert splits_type == "ndarray" and splits == [3, 5]


def nested_backward_worker(rank, world_size):
    """A backward that a Function's backward starts (as Megatron's recomputation does), whose
    nodes allocate on "cuda" (as the recomputed SP gather and MoE all-to-all do)."""
    from megatron.core.tensor_parallel import random as mrandom

    cpu_patches.apply()

    class AllocatesOnCuda(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 3

        @staticmethod
        def backward(ctx, grad):
            buffer = torch.empty(grad.shape, dtype=grad.dtype, device=torch.cuda.current_device())
            return buffer.copy_(grad) * 3

    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(3), requires_grad=True)
    out = mrandom.checkpoint(lambda t: AllocatesOnCuda.apply(t * 2), False, x)  # reentrant: a nested backward
    (out * x.detach()).sum().backward()
    y = torch.randn(3, requires_grad=True)
    torch.autograd.grad(AllocatesOnCuda.apply(y).sum(), y)  # torch.autograd.grad starts one too
    return x.detach(), x.grad


def test_the_cuda_mode_holds_in_a_backward_started_inside_a_backward():
    # Before: "Cannot access accelerator device" (the mode was popped while it ran
    # torch.autograd.backward for Megatron's CheckpointFunction).
    ((x, grad),) = run_ranks(nested_backward_worker, 1, timeout=60)
    assert torch.allclose(grad.double(), 6 * x.double(), rtol=1e-6)


def checkpoint_without_output_worker(rank, world_size):
    """Megatron's ``--recompute-modules layernorm``: the norm runs under CheckpointWithoutOutput,
    the next layer saves a strided view of its output ([s, b, h] -> [b, s, h]), the output's
    storage is freed, and the norm is recomputed in the backward. Any C++ compile fails it."""
    from megatron.core.tensor_parallel import random as mrandom

    Utils.initialize_model_parallel(seed=1234)

    def no_compiler(*args, **kwargs):
        raise AssertionError("a C++ extension compiled at run time (torch.utils.cpp_extension.load_inline)")

    mrandom.load_inline = no_compiler
    gen = torch.Generator().manual_seed(5)
    x, w, weight, bias, grad_z = (torch.randn(*shape, generator=gen) for shape in ((6, 2, 8), (8, 4), (8,), (8,),
                                                                                   (2, 6, 4)))
    x.requires_grad_(True)
    norm = torch.nn.LayerNorm(8)
    with torch.no_grad():
        norm.weight.copy_(weight), norm.bias.copy_(bias)
    checkpoint = mrandom.CheckpointWithoutOutput()
    y = checkpoint.checkpoint(norm, x)  # [s, b, h]
    z = y.transpose(0, 1) @ w  # [b, s, 4]: the matmul keeps the transposed view of y
    checkpoint.discard_output_and_register_recompute(z)
    freed = y.untyped_storage().nbytes()
    z.backward(grad_z)
    return freed, y.untyped_storage().nbytes(), x.detach(), w, weight, bias, grad_z, x.grad, norm.weight.grad


def test_checkpoint_without_output_recomputes_without_compiling_anything():
    # Before: megatron-core's recomputation compiled a C++ extension (load_inline) at the first
    # backward; a rank killed mid-build left torch's lock in ~/.cache/torch_extensions, and every
    # later run with --recompute-modules layernorm / moe_act waited on it for ever.
    ((freed, restored, x, w, weight, bias, grad_z, grad_x, grad_weight),) = run_ranks(
        checkpoint_without_output_worker, 1, timeout=60)
    assert freed == 0 and restored == 6 * 2 * 8 * 4  # freed after the forward, refilled by the recomputation
    x64, weight64 = x.double().requires_grad_(True), weight.double().requires_grad_(True)
    y64 = torch.nn.functional.layer_norm(x64, (8,), weight64, bias.double())
    (y64.transpose(0, 1) @ w.double()).backward(grad_z.double())
    assert torch.allclose(grad_x.double(), x64.grad, rtol=1e-5, atol=1e-5)
    assert torch.allclose(grad_weight.double(), weight64.grad, rtol=1e-5, atol=1e-5)


def uneven_collectives_worker(rank, world_size, sizes):
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    cpu_patches.apply()
    group = dist.new_group(list(range(world_size)))
    shares = [torch.randn(n, 2, 3, generator=torch.Generator().manual_seed(10 + r)) for r, n in enumerate(sizes)]
    full = [torch.randn(sum(sizes), 2, 3, generator=torch.Generator().manual_seed(20 + r)) for r in range(world_size)]
    gathered = mappings._gather_along_first_dim(shares[rank], group, sizes)
    scattered = mappings._reduce_scatter_along_first_dim(full[rank], group, sizes)
    # the gathered grad flows back as the reduce-scatter of the same splits (Megatron's autograd pair)
    x = shares[rank].clone().requires_grad_(True)
    y = mappings.gather_from_sequence_parallel_region(x, group=group, output_split_sizes=sizes)
    (y * full[0]).sum().backward()
    return gathered, scattered, x.grad


@pytest.mark.parametrize("sizes", [[3, 5], [6, 0, 2]])
def test_uneven_sequence_parallel_gather_and_reduce_scatter_on_gloo(sizes):
    """MoE with TP and --sequence-parallel gathers and reduce-scatters the routed tokens with
    uneven split sizes, which gloo refuses: padded on the CPU, equal to the float64 sums."""
    world = len(sizes)
    results = run_ranks(uneven_collectives_worker, world, args=(sizes,), timeout=60)
    shares = [torch.randn(n, 2, 3, generator=torch.Generator().manual_seed(10 + r)).double()
              for r, n in enumerate(sizes)]
    full = [torch.randn(sum(sizes), 2, 3, generator=torch.Generator().manual_seed(20 + r)).double()
            for r in range(world)]
    total = sum(full)
    starts = [sum(sizes[:r]) for r in range(world)]
    for rank, (gathered, scattered, grad) in enumerate(results):
        assert gathered.shape == (sum(sizes), 2, 3) and torch.equal(gathered.double(), torch.cat(shares))
        want = total[starts[rank]:starts[rank] + sizes[rank]]
        assert scattered.shape == want.shape and torch.allclose(scattered.double(), want, rtol=1e-6, atol=1e-6)
        want_grad = (world * full[0])[starts[rank]:starts[rank] + sizes[rank]]
        assert torch.allclose(grad.double(), want_grad, rtol=1e-6, atol=1e-6)


def test_a_triton_stand_in_imports_any_name_and_raises_when_it_is_used():
    stub = cpu_patches.TritonStandIn("megatron.core.ssm.ops.mamba2.batch_invariant_decode")
    decoder_class, kernel = stub.MambaBatchInvariantDecode, stub.causal_conv1d_varlen_fn
    assert stub.MambaBatchInvariantDecode is decoder_class  # one object per name: isinstance, annotations
    assert isinstance(decoder_class, type) and not hasattr(stub, "__path__")
    with pytest.raises(RuntimeError, match="batch_invariant_decode.MambaBatchInvariantDecode needs triton"):
        decoder_class(object())
    with pytest.raises(RuntimeError, match="causal_conv1d_varlen_fn needs triton"):
        kernel(torch.zeros(1))


# Run in a fresh interpreter in which `import triton` fails (whether or not it is installed):
# the shims, then what megatron.training's pretrain and HybridModel import.
IMPORT_WITHOUT_TRITON = """
import sys
sys.modules["triton"] = None  # import triton -> ImportError
from megatron_startrail.megatron import cpu_patches
cpu_patches.install_import_shims()
import megatron.core.package_info as info, megatron.core.ssm.mamba_mixer, megatron.core.models.hybrid.hybrid_model
import megatron.training.training, megatron.training.arguments, megatron.core.transformer.moe.paged_stash
stand_ins = sorted(n for n, m in sys.modules.items() if isinstance(m, cpu_patches.TritonStandIn))
print(info.__version__, info.__file__, stand_ins)
"""


def import_without_triton(megatron_path=None):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = [p for p in (megatron_path, root, os.environ.get("PYTHONPATH")) if p]
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", IMPORT_WITHOUT_TRITON], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": os.pathsep.join(path)})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_megatron_training_imports_without_triton():
    """The installed megatron-core (0.19.2 ships megatron.training and imports triton in the MoE paged stash)."""
    pytest.importorskip("megatron.training")
    line = import_without_triton()
    assert "megatron.core.transformer.moe.ops.paged_stash" in line, line


@pytest.mark.skipif("MEGATRON_LM_MAIN" not in os.environ,
                    reason="set MEGATRON_LM_MAIN to a Megatron-LM checkout (main: d98e8a64)")
def test_megatron_lm_main_training_imports_without_triton():
    """Megatron-LM main (0.20.0) also imports triton in the SSM ops that HybridModel's specs reach."""
    checkout = os.environ["MEGATRON_LM_MAIN"]
    line = import_without_triton(checkout)
    assert line.split()[1].startswith(os.path.abspath(checkout)), line  # the checkout's megatron, not an installed one
    for name in ("megatron.core.ssm.ops.common.causal_conv1d_varlen", "megatron.core.ssm.ops.mamba2.batch_invariant_decode"):
        assert name in line, line


def without_cuda_to_cpu_worker(rank, world_size):
    from torch.overrides import _get_current_function_mode_stack

    cpu_patches.apply(cuda_tensors_to_cpu=False)  # the fake-CUDA rehearsal's way (tests/fake_cuda)
    cpu_patches.apply(cuda_tensors_to_cpu=False)  # idempotent
    modes = [type(m).__name__ for m in _get_current_function_mode_stack()]
    try:
        cpu_patches.apply()  # the other way in the same process: refused
        refused = None
    except RuntimeError as err:
        refused = str(err)
    return cpu_patches.is_applied(), torch.cuda.current_device(), modes, refused


def test_the_patches_can_leave_cuda_tensors_on_cuda():
    ((applied, device, modes, refused),) = run_ranks(without_cuda_to_cpu_worker, 1, timeout=60)
    assert applied and device == 0 and "CudaToCpuMode" not in modes
    assert refused is not None and "cuda_tensors_to_cpu=False" in refused


def fsdp_worker(rank, world_size):
    """Megatron-FSDP's gradient pre-scaling with the div fusion on (its default), and the
    CUDA_DEVICE_MAX_CONNECTIONS that adapt_args leaves for FSDP and for TP / CP without it."""
    import argparse  # noqa: PLC0415
    import os  # noqa: PLC0415

    import torch  # noqa: PLC0415
    from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig  # noqa: PLC0415
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer  # noqa: PLC0415

    cpu_patches.apply()
    config = DistributedDataParallelConfig(gradient_reduce_div_fusion=True)
    grad = torch.randn(7, generator=torch.Generator().manual_seed(3))
    want = grad * 0.25
    op = param_and_grad_buffer.gradient_reduce_preprocessing(grad, 0.25, config)
    connections = []
    for fsdp in (True, False, True):
        cpu_patches.adapt_args(argparse.Namespace(use_megatron_fsdp=fsdp, use_torch_fsdp2=False))
        connections.append(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"))
    return op == torch.distributed.ReduceOp.SUM, torch.equal(grad, want), config.gradient_reduce_div_fusion, connections


def test_megatron_fsdp_reduces_with_sum_after_scaling_and_fsdp_gets_its_connections():
    """gloo has no PREMUL_SUM: the bucket is scaled in place, then summed (Megatron-FSDP's own
    unfused branch), the caller's config unchanged; FSDP runs without the CUDA_DEVICE_MAX_CONNECTIONS
    = 1 that TP / CP without FSDP need (both Megatron's validate_args rules)."""
    ((is_sum, scaled, fusion_kept, connections),) = run_ranks(fsdp_worker, 1, timeout=60)
    assert is_sum and scaled and fusion_kept
    assert connections == [None, "1", None]
