"""Which block kernel runs: one pure function of what the attention call is given.

:func:`choose_kernel` decides from the device type, dtype, q/k head dim, v head dim, GQA
ratio, the layer's class (batch, mask, packed documents), the GPU's compute capability and
the set of usable kernel backends (probed by :func:`megatron_startrail.kernels.usable_backends`
and :func:`megatron_startrail.kernels.cuda_device`, passed in here so that every rule can be
tested on a CPU). What each kernel can take (:data:`RULES`; a forced ``--startrail-kernel``
is held to it)::

    kernel                device  dtypes                  head dims (q/k, v)        needs
    torch_cpu_flash       cpu     fp32 fp64 bf16 fp16     any; V padded if != q/k    -
    flash_attn_3          cuda    bf16 fp16               <= 256; V padded           flash_attn_3
    flash_attn            cuda    bf16 fp16               <= 256; V padded           flash_attn
    torch_cuda_flash      cuda    bf16 fp16               <= 256; V padded           torch_flash
    torch_cuda_efficient  cuda    bf16 fp16 fp32          any, v may differ          torch_efficient
    torch_cuda_cudnn      cuda    bf16 fp16               <= 128; V padded           torch_cudnn
    torch_cuda_cudnn_varlen cuda  bf16 fp16               <= 128; V padded           torch_cudnn
    reference             any     any                     any                        -  (last resort)

``auto`` on a CPU takes ``torch_cpu_flash``; on CUDA it follows the device's table of
measured kernels (:mod:`megatron_startrail.kernels.measured`: on sm90 cuDNN for dense layers,
PyTorch's FlashAttention for packed documents, windows and MLA dims, the memory-efficient op
for float32 without a mask; a conservative order on unmeasured GPUs), and the reference
kernel, with one warning saying why, where no measured kernel fits.

"V padded" means the kernel wants one head dim for q, k and v: V (and out, dO in the
backward) get zero columns up to the common dim inside the call, and the result is cut
back; nothing padded ever leaves the call (docs/design.md, "Block kernels").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .measured import MASKS, DeviceTable, device_table, head_dim_class

HALF = (torch.bfloat16, torch.float16)

# What a backend name in ``KernelRequest.available`` stands for (used in error messages).
BACKENDS = {
    "flash_attn_3": ("flash-attn 3 (the `flash_attn_interface` module of flash-attn's hopper/ build, on sm90; "
                     "not a build of 2025-07-11 .. 08-28, which returns no lse)"),
    "flash_attn": "flash-attn 2.x >= 2.6 (`pip install flash-attn`, sm80+)",
    "torch_flash": "PyTorch's FlashAttention op (a CUDA build of torch, sm80+)",
    "torch_efficient": "PyTorch's memory-efficient attention op (a CUDA build of torch)",
    "torch_cudnn": "PyTorch's cuDNN attention op (cuDNN >= 9 in the torch build, sm80+)",
}


@dataclass(frozen=True)
class KernelRule:
    """What one kernel accepts. ``max_head_dim`` bounds ``max(q/k dim, v dim)``."""

    name: str
    device_type: str | None  # None: any device
    dtypes: tuple[torch.dtype, ...] | None  # None: any dtype
    max_head_dim: int | None
    needs: str | None  # a key of BACKENDS that must be usable
    pads_v: bool  # needs equal head dims: V is padded inside the call when they differ
    auto: bool  # ``auto`` may pick it (on CUDA where the device's table of measured kernels has it)
    what: str


RULES = (
    KernelRule("torch_cpu_flash", "cpu", (torch.float32, torch.float64) + HALF, None, None, True, True,
               "aten::_scaled_dot_product_flash_attention_for_cpu"),
    KernelRule("flash_attn_3", "cuda", HALF, 256, "flash_attn_3", True, True, "flash-attn 3 (Hopper)"),
    KernelRule("flash_attn", "cuda", HALF, 256, "flash_attn", True, True, "flash-attn 2.x"),
    KernelRule("torch_cuda_flash", "cuda", HALF, 256, "torch_flash", True, True,
               "aten::_scaled_dot_product_flash_attention"),
    KernelRule("torch_cuda_efficient", "cuda", HALF + (torch.float32,), None, "torch_efficient", False, True,
               "aten::_scaled_dot_product_efficient_attention"),
    KernelRule("torch_cuda_cudnn", "cuda", HALF, 128, "torch_cudnn", True, True,
               "aten::_scaled_dot_product_cudnn_attention"),
    # packed documents in one launch (kernels/cudnn_varlen.py); no device's table has it yet
    KernelRule("torch_cuda_cudnn_varlen", "cuda", HALF, 128, "torch_cudnn", True, True,
               "aten::_cudnn_attention_forward (variable length)"),
    KernelRule("reference", None, None, None, None, False, True, "pure PyTorch (float32 math)"),
)
RULES_BY_NAME = {rule.name: rule for rule in RULES}
KERNELS = ("auto",) + tuple(RULES_BY_NAME)


@dataclass(frozen=True)
class KernelRequest:
    """Everything the choice depends on; build it with ``KernelRequest.of(q, k, v, available)``.

    The layer's class (``batch``, ``mask``: "none", "causal" or "window", ``packed``: documents)
    and the GPU's ``capability`` pick the row of the device's table of measured kernels; the
    defaults (batch 1, causal, one sequence, an unknown GPU) are the common Megatron layer."""

    device_type: str
    dtype: torch.dtype
    qk_head_dim: int
    v_head_dim: int
    gqa_ratio: int = 1  # query heads per K/V head
    available: frozenset[str] = frozenset()
    batch: int = 1
    mask: str = "causal"
    packed: bool = False  # packed documents (cu_seqlens): variable-length calls
    capability: tuple[int, int] | None = None  # torch.cuda.get_device_capability; None: not known

    def __post_init__(self):
        if self.mask not in MASKS:
            raise ValueError(f"KernelRequest mask={self.mask!r} is not one of {MASKS}")

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, available=frozenset(), *, mask: str = "causal",
           packed: bool = False, capability: tuple[int, int] | None = None) -> KernelRequest:
        """From q ``[..., b, h, d_qk]``, k ``[..., hkv, d_qk]``, v ``[..., hkv, d_v]`` (heads at dim -2;
        the batch at dim -3 of a 4-d q, else 1)."""
        batch = q.shape[-3] if q.dim() >= 4 else 1
        return cls(q.device.type, q.dtype, q.shape[-1], v.shape[-1], max(1, q.shape[-2] // max(1, k.shape[-2])),
                   frozenset(available), batch, mask, packed, capability)

    def describe(self) -> str:
        dims = f"head dim {self.qk_head_dim}" if self.qk_head_dim == self.v_head_dim else (
            f"q/k head dim {self.qk_head_dim}, v head dim {self.v_head_dim}")
        layer = f"batch {self.batch}, mask {self.mask}" + (", packed documents" if self.packed else "")
        return f"{self.dtype} on {self.device_type}, {dims}, GQA ratio {self.gqa_ratio}, {layer}"


@dataclass(frozen=True)
class KernelChoice:
    name: str
    reason: str


def _dtype_names(dtypes) -> str:
    return "/".join(str(d).removeprefix("torch.") for d in dtypes)


def kernel_constraint(name: str, req: KernelRequest) -> str | None:
    """Why kernel ``name`` cannot take ``req``'s inputs, or None when it can."""
    rule = RULES_BY_NAME[name]
    if rule.device_type is not None and rule.device_type != req.device_type:
        return f"{name} runs on {rule.device_type} tensors, these are on {req.device_type}"
    if rule.needs is not None and rule.needs not in req.available:
        return f"{name} needs {BACKENDS[rule.needs]}, which is not usable here"
    if rule.dtypes is not None and req.dtype not in rule.dtypes:
        return f"{name} takes {_dtype_names(rule.dtypes)} inputs, not {str(req.dtype).removeprefix('torch.')}"
    widest = max(req.qk_head_dim, req.v_head_dim)
    if rule.max_head_dim is not None and widest > rule.max_head_dim:
        return (f"{name} takes head dims up to {rule.max_head_dim}, got q/k {req.qk_head_dim}, "
                f"v {req.v_head_dim}")
    return None


def _padding_note(rule: KernelRule, req: KernelRequest) -> str:
    if rule.pads_v and req.qk_head_dim != req.v_head_dim:
        return f"; V padded from {req.v_head_dim} to {max(req.qk_head_dim, req.v_head_dim)} inside the call"
    return ""


def choose_kernel(req: KernelRequest, name: str = "auto") -> KernelChoice:
    """The kernel for ``req``: ``name`` if forced (ValueError when it cannot take the
    inputs), else ``auto``'s: on CUDA the device's table of measured kernels, elsewhere the
    first rule of the device that can take them; the reference kernel where none can."""
    if name not in KERNELS:
        raise ValueError(f"--startrail-kernel / kernel={name!r} is not one of {KERNELS}")
    if name != "auto":
        why_not = kernel_constraint(name, req)
        if why_not is not None:
            raise ValueError(
                f"--startrail-kernel {name} (kernel={name!r}) cannot take these inputs ({req.describe()}): "
                f"{why_not}; use --startrail-kernel auto or another kernel"
            )
        return KernelChoice(name, f"forced by --startrail-kernel{_padding_note(RULES_BY_NAME[name], req)}")
    if req.device_type == "cuda":
        return _choose_measured(req, device_table(req.capability))
    own = [rule for rule in RULES if rule.auto and rule.device_type == req.device_type]
    for rule in own:
        if kernel_constraint(rule.name, req) is None:
            return KernelChoice(rule.name, f"{rule.what} takes {req.describe()}{_padding_note(rule, req)}")
    if own:
        return KernelChoice("reference", f"no fused kernel takes {req.describe()}: "
                            + "; ".join(kernel_constraint(rule.name, req) for rule in own))
    fused = ", ".join(f"{r.name} ({r.device_type})" for r in RULES if r.device_type and r.auto)
    return KernelChoice("reference", f"no fused kernel runs on {req.device_type} (there are: {fused})")


def _layer_class(req: KernelRequest) -> tuple[str | None, str, str, bool, str]:
    """``req``'s class in the device tables: (dtype, batch, mask, packed, head dims)."""
    dtype = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(req.dtype)
    return (dtype, "1" if req.batch == 1 else ">1", req.mask, req.packed,
            head_dim_class(req.qk_head_dim, req.v_head_dim))


def _choose_measured(req: KernelRequest, table: DeviceTable) -> KernelChoice:
    """The first rule of ``table`` for ``req``'s class whose kernel can take the inputs; else the
    reference kernel, with why each CUDA kernel could not (unusable here, or left out)."""
    cls = _layer_class(req)
    unusable = []  # rules of this class passed over: their kernel cannot run here
    for rule in table.rules:
        if rule.matches(*cls):
            why_not = kernel_constraint(rule.kernel, req)
            if why_not is None:
                skipped = f" (passed over: {'; '.join(unusable)})" if unusable else ""
                return KernelChoice(rule.kernel, rule.reason + _padding_note(RULES_BY_NAME[rule.kernel], req) + skipped)
            unusable.append(why_not)
    why = []
    for rule in RULES:
        if rule.device_type != "cuda":
            continue
        why_not = kernel_constraint(rule.name, req)
        left_out = next((r.reason for r in table.left_out if r.kernel == rule.name and r.matches(*cls)), None)
        why.append(why_not or left_out or f"{rule.name} is not in the table for this class (unmeasured there)")
    return KernelChoice("reference", f"no fused kernel of the {table.name} table takes {req.describe()}: "
                                     + "; ".join(why))
