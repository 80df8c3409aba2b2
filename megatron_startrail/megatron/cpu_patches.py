"""Run megatron-core on a CPU-only PyTorch (for development, CI and the CPU main job).

megatron-core assumes CUDA in a handful of places (docs/design.md, "megatron-core on a CPU-only PyTorch").
Everything that works around that lives here, and nothing here is used when a GPU is
present: :func:`apply` refuses to run when ``torch.cuda.is_available()``, and the
example calls it only on CPU-only machines.

Stages, because one blocker is at import time:

- :func:`install_import_shims` (before ``import megatron``): ``typing.override`` for
  Python 3.11 (``megatron.training`` imports it from ``typing``, new in 3.12), and, when
  triton cannot be imported, a stand-in for each Megatron module in :data:`TRITON_MODULES`:
  the modules of triton kernels that ``megatron.core`` / ``megatron.training`` import
  unguarded (a fake top-level ``triton`` would break torch's inductor). Every name taken
  from a stand-in is a class that raises when called, naming the module and triton.
- :func:`apply` (after import): the model-parallel RNG tracker on CPU generator states,
  ``torch.cuda`` stream/synchronize/device/RNG helpers as no-ops, grad clipping without
  the CUDA-tensor assertion, ``megatron.training``'s CUDA checks and JIT warm-up off,
  the local spec's norm with ``--sequence-parallel`` (what Transformer Engine's norm does
  on a GPU), the MoE all-to-all dispatcher's split sizes as host lists, the final norm of
  ``HybridModel``'s stack from torch (it is Transformer Engine's, whatever the spec), and a
  ``TorchFunctionMode`` that maps every ``device="cuda"`` / ``.cuda()`` /
  ``pin_memory=True`` to the CPU, which covers the hard-coded CUDA allocations in one
  place.
- :func:`adapt_args` / :func:`adapt_config`: the fused CUDA kernels off in Megatron's
  parsed arguments or in a ``TransformerConfig``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import sys
import types
import typing

import torch
from torch.overrides import TorchFunctionMode

_state = {"applied": False, "mode": None, "set_max_connections": False}

# Megatron modules of triton kernels that an ``import megatron.core`` / ``megatron.training``
# reaches unguarded (``import triton`` at their top), with the constants importers read from
# them at import time. Each gets a stand-in when triton is missing.
TRITON_MODULES = {
    # megatron-core 0.19.2: MoE paged stash (moe/paged_stash.py imports it)
    "megatron.core.transformer.moe.ops.paged_stash": {"GLOBAL_BLOCK_SIZE": 0},
    # Megatron-LM main (0.20.0, d98e8a64): megatron.training -> models/hybrid ->
    # hybrid_layer_specs -> ssm/gated_delta_product and ssm/mamba_mixer import these
    "megatron.core.ssm.ops.common.causal_conv1d_varlen": {},
    "megatron.core.ssm.ops.mamba2.batch_invariant_decode": {},
}


class _NeedsTriton:
    """A name taken from a stand-in module: using it (calling, instantiating) raises."""

    _where = "triton"

    def __new__(cls, *args, **kwargs):
        raise RuntimeError(f"{cls._where} needs triton and a GPU (a CPU stand-in: megatron_startrail cpu_patches)")


class TritonStandIn(types.ModuleType):
    """Stands in for a Megatron module that imports triton: every name it is asked for is a
    :class:`_NeedsTriton` class (the same one on every access), so ``from module import
    kernel, Class`` works and ``kernel(...)`` / ``Class(...)`` raise."""

    def __getattr__(self, name: str):
        if name.startswith("__"):  # __path__, __file__, ...: a plain module has none
            raise AttributeError(name)
        standin = type(name, (_NeedsTriton,), {"_where": f"{self.__name__}.{name}", "__module__": self.__name__})
        setattr(self, name, standin)
        return standin


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


def install_import_shims() -> None:
    """Make ``import megatron.core`` / ``megatron.training`` work on Python 3.11 without triton."""
    if not hasattr(typing, "override"):
        import typing_extensions  # noqa: PLC0415

        typing.override = typing_extensions.override
    missing = [name for name in TRITON_MODULES if name not in sys.modules]
    if missing and not _triton_importable():
        for name in missing:
            stub = TritonStandIn(name, "CPU stand-in (megatron_startrail cpu_patches): the real module needs triton.")
            for constant, value in TRITON_MODULES[name].items():
                setattr(stub, constant, value)
            sys.modules[name] = stub


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class CudaToCpuMode(TorchFunctionMode):
    """Send every CUDA device request to the CPU (and drop pinned memory)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = torch.device("cpu")
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func in (torch.Tensor.to, torch.Tensor.pin_memory):
            if func is torch.Tensor.pin_memory:
                return args[0]
            args = tuple(torch.device("cpu") if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


class _NoStream:
    """Stands in for ``torch.cuda.Stream``: everything on the CPU is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args):
        pass

    def wait_event(self, *args):
        pass

    def record_event(self, *args):
        return _NoEvent()

    def synchronize(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _NoEvent(_NoStream):
    def record(self, *args):
        pass

    def wait(self, *args):  # Megatron-FSDP waits on its all-gather / reduce-scatter events
        pass

    def query(self):
        return True

    def elapsed_time(self, *args):
        return 0.0


def _keep_mode_in_nested_backward(mode: CudaToCpuMode) -> None:
    """Run every backward pass that a call handled by ``mode`` starts under ``mode``.

    A ``TorchFunctionMode`` is thread-local, and while its ``__torch_function__`` runs, torch
    pops it off the stack (so that the ``func`` it calls does not come back to it). That is
    harmless for an op, but ``torch.autograd.backward`` / ``grad`` are overridable too: the
    backward that Megatron's recomputation (``CheckpointFunction.backward``) starts from inside
    the outer backward reaches the mode, which calls it with itself popped. The autograd engine
    captures the thread's state, mode stack included, when it builds the nested graph task, so
    every node of the recomputed backward (the SP all-gather's ``torch.empty(...,
    device=torch.cuda.current_device())``, the MoE all-to-all's buffers) ran without the mode:
    "Cannot access accelerator device". (It is the same thread, not an autograd worker.)

    ``_engine_run_backward`` is the one Python function below both entry points and above the
    C++ engine; it makes no torch-function check of its own. Patched at module level (not
    thread-local state), it pushes the mode back when it is missing, so the graph task
    captures it, on whichever thread the engine runs a node. torch patches the same two names
    for make_fx (``torch.compiler``)."""
    from torch.autograd import graph  # noqa: PLC0415

    original = graph._engine_run_backward

    @functools.wraps(original)
    def _engine_run_backward(*args, **kwargs):
        if mode in torch.overrides._get_current_function_mode_stack():
            return original(*args, **kwargs)
        with mode:
            return original(*args, **kwargs)

    graph._engine_run_backward = torch.autograd._engine_run_backward = _engine_run_backward


def _patch_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom  # noqa: PLC0415

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

    mrandom.CudaRNGStatesTracker.add = add
    mrandom.CudaRNGStatesTracker.fork = fork
    mrandom._set_cuda_rng_state = lambda new_state, *a, **k: None
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()


def _patch_checkpoint_without_output() -> None:
    """``CheckpointWithoutOutput`` (``--recompute-modules layernorm`` / ``moe_act``) sets
    ``self.fp8 = fp8 is not None``: true for its default ``fp8=False``, so it always asks
    Transformer Engine's ``FP8GlobalStateManager`` whether FP8 is on, a name that is undefined
    without TE (``NameError``). With TE and FP8 off it then takes the plain path; without TE
    FP8 cannot be on, so on the CPU the plain path is taken directly."""
    from megatron.core.tensor_parallel import random as mrandom  # noqa: PLC0415

    if mrandom.HAVE_TE:
        return
    init = mrandom.CheckpointWithoutOutput.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.fp8 = False

    mrandom.CheckpointWithoutOutput.__init__ = __init__


def _share_storage_by_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Put ``src``'s bytes back into ``dst``'s storage, which ``discard_output_and_register_recompute``
    resized to 0 bytes: every view of that storage (what the following layers saved for their
    backward) reads the recomputed values. A copy, where megatron-core's extension makes the
    storage point at ``src``'s memory; the storage object, its views and version counters are
    the same ones, and its size is ``src``'s storage's (the same layout, as the extension assumes)."""
    with torch.no_grad():
        dst.untyped_storage().resize_(src.untyped_storage().nbytes())
        dst.untyped_storage().copy_(src.untyped_storage())


def _patch_share_storage() -> None:
    """``CheckpointWithoutOutput._recompute`` (``--recompute-modules layernorm``, ``moe_act``,
    ``mla_up_proj``) hands the recomputed outputs back through ``_get_share_storage()``, a C++
    extension that megatron-core 0.19 compiles with ``load_inline`` at the first backward that
    needs it: a compiler, minutes of a 2-core CPU, and torch's build lock in
    ``~/.cache/torch_extensions``. A rank killed mid-build (a test's timeout) leaves that lock
    file behind, and every later run in that home directory waits on it for ever, at any CP
    size, with no error. On the CPU the same outputs come back by a copy, nothing compiled."""
    from megatron.core.tensor_parallel import random as mrandom  # noqa: PLC0415

    if hasattr(mrandom, "_get_share_storage"):  # megatron-core 0.19 (not in every version)
        mrandom._get_share_storage = lambda: _share_storage_by_copy


def _patch_grad_clipping() -> None:
    """Megatron's clipping asserts ``torch.cuda.FloatTensor`` grads; same math on the CPU."""
    from megatron.core.optimizer import optimizer as moptimizer  # noqa: PLC0415

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        grads = [getattr(p, attr) for p in parameters if getattr(p, attr, None) is not None]
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if isinstance(clip_coeff, torch.Tensor):
            clip_coeff = clip_coeff.clamp_max(1.0)
        elif clip_coeff >= 1.0:
            return
        for g in grads:
            g.detach().mul_(clip_coeff)

    moptimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32


def _patch_norm_for_sequence_parallel() -> None:
    """The local spec's norm (``WrappedTorchNorm``: torch's LayerNorm / RMSNorm) asserts
    ``--sequence-parallel`` off; on a GPU Transformer Engine's norm takes it. MoE with tensor
    parallelism needs it (``MoELayer`` refuses to train TP > 1 without it).

    A norm acts on each token alone, so under sequence parallelism ([s/TP, b, h] per TP
    rank) it is the same module; only its weight gradient is a partial sum over this TP
    rank's tokens. Marking the parameters ``sequence_parallel`` (what apex's and TE's
    norms do) makes Megatron's ``finalize_model_grads`` sum them over the TP group."""
    from megatron.core.transformer import torch_norm  # noqa: PLC0415

    original = torch_norm.WrappedTorchNorm.__new__

    def __new__(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
        if not config.sequence_parallel:
            return original(cls, config, hidden_size, eps, *args, **kwargs)
        if config.normalization not in ("LayerNorm", "RMSNorm") or config.layernorm_zero_centered_gamma:
            raise ValueError(
                f"--sequence-parallel on the CPU takes --normalization LayerNorm or RMSNorm without "
                f"--apply-layernorm-1p (got {config.normalization})"
            )
        norm_cls = torch.nn.LayerNorm if config.normalization == "LayerNorm" else torch.nn.RMSNorm
        norm = norm_cls(hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(__new__)


def _patch_moe_split_sizes() -> None:
    """The all-to-all token dispatcher (``--moe-token-dispatcher-type alltoall``) moves its
    split sizes to the host with ``maybe_move_tensor_to_cpu(..., as_numpy=True)``, which
    converts CUDA tensors only; on the CPU they would stay tensors, which
    ``all_to_all_single`` does not take as split sizes. Convert CPU tensors the same way."""
    from megatron.core.transformer.moe import token_dispatcher  # noqa: PLC0415

    original = token_dispatcher.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _patch_uneven_sequence_parallel_collectives() -> None:
    """MoE with tensor parallelism and ``--sequence-parallel`` gathers and reduce-scatters the
    routed tokens over the TP group with per-rank split sizes (``mappings._gather_along_first_dim``
    / ``_reduce_scatter_along_first_dim`` with ``output_split_sizes`` / ``input_split_sizes``):
    ``all_gather`` / ``reduce_scatter`` of a list of unequal tensors, which NCCL runs and gloo
    refuses ("ProcessGroupGloo::allgather: invalid tensor size"). On the CPU each rank's share is
    padded to the largest, moved with the even collective, and cut back: the same sums, entry for
    entry. Calls with equal splits (or none) go to Megatron's functions unchanged."""
    from megatron.core.tensor_parallel import mappings  # noqa: PLC0415

    gather, reduce_scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def _padded(parts: list, rows: int) -> torch.Tensor:
        """[len(parts) * rows, ...]: each part [n_i, ...] followed by rows - n_i zero rows."""
        return torch.cat([torch.nn.functional.pad(p, (0, 0) * (p.dim() - 1) + (0, rows - p.shape[0])) for p in parts])

    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or len(set(output_split_sizes)) == 1 or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        rows = max(output_split_sizes)
        out = torch.empty((group.size() * rows, *input_.shape[1:]), dtype=input_.dtype, device=input_.device)
        torch.distributed.all_gather_into_tensor(out, _padded([input_.contiguous()], rows), group=group)
        return torch.cat([out[i * rows:i * rows + n] for i, n in enumerate(output_split_sizes)])

    def _reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or len(set(input_split_sizes)) == 1 or group.size() == 1:
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        rows = max(input_split_sizes)
        out = torch.empty((rows, *input_.shape[1:]), dtype=input_.dtype, device=input_.device)
        torch.distributed.reduce_scatter_tensor(out, _padded(list(torch.split(input_, input_split_sizes)), rows),
                                                group=group)
        return out[:input_split_sizes[group.rank()]]

    mappings._gather_along_first_dim = _gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = _reduce_scatter_along_first_dim


def _patch_hybrid_final_norm() -> None:
    """``HybridStack`` (``HybridModel``'s decoder) builds its final norm as Transformer Engine's
    ``TENorm`` whatever its spec says; without TE that raises. On the CPU it is the local spec's
    norm (torch's LayerNorm / RMSNorm, with the same constructor arguments)."""
    try:
        from megatron.core.models.hybrid import hybrid_block  # noqa: PLC0415
    except ImportError:  # megatron-core 0.16.x: no HybridModel (hybrid_specs refuses it)
        return
    from megatron.core.transformer.torch_norm import WrappedTorchNorm  # noqa: PLC0415

    hybrid_block.TENorm = WrappedTorchNorm


def _patch_torch_fsdp2_mesh() -> None:
    """``--use-torch-fsdp2``: Megatron's ``TorchFullyShardedDataParallel`` builds its device mesh
    as ``DeviceMesh.from_group(group, "cuda")``, so torch's ``fully_shard`` expects every
    parameter on ``cuda:0`` ("Expects the parameter to already be moved to device cuda:0 but got
    cpu"). On the CPU the mesh is the same group's on ``cpu`` (gloo), where the parameters are."""
    try:
        from megatron.core.distributed import torch_fully_sharded_data_parallel as tfsdp  # noqa: PLC0415
    except ImportError:
        return
    if not getattr(tfsdp, "HAVE_FSDP", False):
        return
    mesh = tfsdp.DeviceMesh

    class CpuDeviceMesh:
        @staticmethod
        def from_group(group, device_type, *args, **kwargs):
            return mesh.from_group(group, "cpu" if _is_cuda(device_type) else device_type, *args, **kwargs)

    tfsdp.DeviceMesh = CpuDeviceMesh


def _patch_megatron_fsdp_premul_sum() -> None:
    """``--use-megatron-fsdp`` reduces gradients with NCCL's ``PREMUL_SUM`` (the scaling by
    1 / (DP x CP) fused into the reduce-scatter) when ``gradient_reduce_div_fusion`` is on, its
    default; gloo has no such op ("Cannot use ReduceOp.PREMUL_SUM with Gloo"). On the CPU the
    same sum is Megatron-FSDP's own unfused branch: multiply the bucket by the factor, then SUM
    (``gradient_reduce_preprocessing`` with the fusion off)."""
    try:
        from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer  # noqa: PLC0415
    except ImportError:
        return
    original = param_and_grad_buffer.gradient_reduce_preprocessing

    @functools.wraps(original)
    def gradient_reduce_preprocessing(grad_data, scaling_factor, ddp_config):
        if getattr(ddp_config, "gradient_reduce_div_fusion", False):
            ddp_config = copy.copy(ddp_config)  # the caller's config unchanged
            ddp_config.gradient_reduce_div_fusion = False
        return original(grad_data, scaling_factor, ddp_config)

    param_and_grad_buffer.gradient_reduce_preprocessing = gradient_reduce_preprocessing


def _patch_megatron_training() -> None:
    """``megatron.training`` (``parse_args``, ``pretrain``) on the CPU; absent before 0.17."""
    try:
        from megatron.training import arguments as training_arguments  # noqa: PLC0415
        from megatron.training import initialize as training_initialize  # noqa: PLC0415
        from megatron.training import training as training_loop  # noqa: PLC0415
    except ImportError:  # megatron-core without megatron.training (0.16.x)
        return
    # validate_args asks for the GPU architecture ...
    training_arguments.get_device_arch_version = lambda: 0
    # ... and insists on this CUDA setting for TP/CP without FSDP (meaningless on the CPU;
    # adapt_args takes it back for FSDP, which insists on the opposite).
    if "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ:
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
        _state["set_max_connections"] = True  # ours: adapt_args may take it back
    # pretrain asserts CUDA unless initialize_megatron is told otherwise.
    training_loop.initialize_megatron = functools.partial(
        training_initialize.initialize_megatron, allow_no_cuda=True
    )
    # The JIT warm-up runs the fused bias-GeLU/dropout kernels on CUDA tensors; there is
    # nothing to warm up on the CPU, where those fusions are off (adapt_args).
    training_loop.set_jit_fusion_options = lambda *args, **kwargs: None


def apply(cuda_tensors_to_cpu: bool = True) -> None:
    """Patch megatron-core and ``torch.cuda`` for a CPU-only run; idempotent. With
    ``cuda_tensors_to_cpu=False`` the CUDA tensors Megatron makes stay CUDA tensors (no
    :class:`CudaToCpuMode`): a rehearsal on fake CUDA (tests/fake_cuda) wants Megatron's answers
    from ``torch.cuda`` but not its tensors moved."""
    if torch.cuda.is_available():
        raise RuntimeError("megatron_startrail.megatron.cpu_patches is for CPU-only runs; a GPU is present")
    if _state["applied"]:
        if (_state["mode"] is not None) != cuda_tensors_to_cpu:
            raise RuntimeError(f"cpu_patches were applied with cuda_tensors_to_cpu={not cuda_tensors_to_cpu}: "
                               f"one process takes one of the two")
        return
    install_import_shims()
    _patch_rng_tracker()
    _patch_grad_clipping()
    _patch_checkpoint_without_output()
    _patch_share_storage()
    _patch_norm_for_sequence_parallel()
    _patch_moe_split_sizes()
    _patch_uneven_sequence_parallel_collectives()
    _patch_hybrid_final_norm()
    _patch_torch_fsdp2_mesh()
    _patch_megatron_fsdp_premul_sum()
    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_stream = lambda *a, **k: _NoStream()
    torch.cuda.default_stream = lambda *a, **k: _NoStream()
    torch.cuda.Stream = _NoStream
    torch.cuda.Event = _NoEvent
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.manual_seed = lambda *a, **k: None
    torch.cuda.manual_seed_all = lambda *a, **k: None
    torch.cuda.device_count = lambda: 0
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.empty_cache = lambda: None
    # Megatron's rerun state machine saves and restores the CUDA RNG with the CPU one.
    torch.cuda.get_rng_state = lambda *a, **k: torch.empty(0, dtype=torch.uint8)
    torch.cuda.set_rng_state = lambda *a, **k: None
    _patch_megatron_training()
    if cuda_tensors_to_cpu:
        mode = CudaToCpuMode()
        mode.__enter__()  # for the life of the process
        _keep_mode_in_nested_backward(mode)
        _state["mode"] = mode
    _state["applied"] = True


def is_applied() -> bool:
    return _state["applied"]


# Fused CUDA/apex kernels that megatron.training turns on by default.
_GPU_ONLY_FUSIONS = (
    "gradient_accumulation_fusion",
    "persist_layer_norm",
    "apply_rope_fusion",
    "masked_softmax_fusion",
    "bias_dropout_fusion",
    "bias_activation_fusion",
    "cross_entropy_loss_fusion",
)


def adapt_args(args) -> None:
    """CPU values for Megatron's parsed arguments (before ``validate_args``)."""
    for name in _GPU_ONLY_FUSIONS + ("bias_gelu_fusion", "bias_swiglu_fusion"):
        if hasattr(args, name):
            setattr(args, name, False)
    args.no_persist_layer_norm = True
    args.use_cpu_initialization = True
    args.distributed_backend = "gloo"
    args.transformer_impl = "local"  # Transformer Engine is GPU-only
    if _state["set_max_connections"]:
        # validate_args wants CUDA_DEVICE_MAX_CONNECTIONS == "1" for TP / CP without FSDP and
        # != "1" with FSDP (a CUDA stream setting, meaningless on the CPU). Only the value that
        # apply() set is changed: a user's own stays, and Megatron names it.
        if getattr(args, "use_torch_fsdp2", False) or getattr(args, "use_megatron_fsdp", False):
            os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
        else:
            os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"


def adapt_config(config) -> None:
    """Turn off the GPU-only fusions and synchronizations in a ``TransformerConfig``."""
    for name in _GPU_ONLY_FUSIONS:
        if hasattr(config, name):
            setattr(config, name, False)
    config.batch_p2p_sync = False
