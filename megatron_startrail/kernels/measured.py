"""``auto``'s kernel order on CUDA, per device, from committed GPU measurements.

A kernel enters a device's table for a class of attention layers only where a committed GPU
table shows it PASS there (``benchmarks/results/gpu/*/accuracy.json``, made by
``python -m benchmarks.gpu.tables`` from the kit's tables); each rule's reason cites its
figure and file. ``tests/test_measured_kernels.py`` holds the rules to those tables.

A class is what changes which kernel is right or fast:

- dtype: ``bf16``, ``fp16``, ``fp32``;
- batch: ``1`` or ``>1`` (the efficient adapter was wrong only at batch > 1);
- mask of the layer: ``none``, ``causal``, ``window`` (any sliding window), and ``packed``
  (documents, ``cu_seqlens``). The block planner turns a layer into calls of these kinds
  (:func:`layer_kinds`, Note [kernel calls] in :mod:`megatron_startrail.layout`);
- head dims: the wider of q/k and v, ``<=128``, ``<=256`` or ``>256``.

The tables (first row of the device's table that fits and whose kernel is usable wins; none:
the reference kernel, with the reasons the others were left out)::

    device           kernel                dtypes     head dims     masks                  batch
    sm90 (H100/200)  torch_cuda_cudnn      bf16 fp16  <=128         none, causal; dense    1, >1 (*)
                     torch_cuda_flash      bf16 fp16  <=256         any, packed too        1, >1 (*)
                     torch_cuda_efficient  fp32       <=256         none, packed too       1, >1 (*)
    others (sm80:    flash_attn            bf16 fp16  <=256         any                    1, >1
    A100, ...;       torch_cuda_flash      bf16 fp16  <=256         any                    1, >1
    unmeasured)      torch_cuda_efficient  fp32       any           none                   1, >1
                     torch_cuda_efficient  bf16 fp16  any           none                   1

    (*) batch 1 rests on the batch-2 rows: the kit of 9ee7a82 measured accuracy at batch 2
        only; batch 1 ran on the H100 (the one-rank timings) without being compared.

Left out, with their reasons: ``torch_cuda_efficient`` in half precision at batch > 1 and for
every masked layer (wrong gradients and raised calls on the H100, until a GPU confirms the
fixed adapter); on sm90 ``flash_attn_3`` and ``flash_attn`` (not installed on the H100:
unmeasured; force them with ``--startrail-kernel``); ``torch_cuda_cudnn_varlen`` everywhere
(cuDNN's ragged op for packed documents: never run on a GPU; it enters the sm90 table for
packed layers when a committed table shows it PASS and faster than ``torch_cuda_flash``).

A GPU no table measures whose compute capability is 9 or more (B200/GB200 sm100, sm120...)
follows the sm90 table, cuDNN first, as Transformer Engine ranks cuDNN on Hopper and Blackwell
alike (:func:`device_table`; each reason says so, and ``kernels.kernel_for`` warns once); older
ones (A100-class sm80) keep the conservative order above.
"""

from __future__ import annotations

from dataclasses import dataclass

# The H100 run of 2026-11-27, on 9ee7a82 (benchmarks/results/gpu/h100-2026-11-27/README.md)
ACCURACY = "benchmarks/results/gpu/h100-2026-11-27/accuracy.md"
TIMING = "benchmarks/results/gpu/h100-2026-11-27/timing_rank_transport.md"
NOTES = "benchmarks/results/gpu/h100-2026-11-27/README.md"
EXPERIMENT = "benchmarks/results/gpu/h100-2026-11-27/efficient_experiment.jsonl"
MASKS = ("none", "causal", "window")
HEAD_DIMS = ("<=128", "<=256", ">256")
BATCHES = ("1", ">1")
HALF = ("bf16", "fp16")
ANY = object()  # a rule field that matches every value

BATCH_1_NOTE = ("batch 1 rests on the batch-2 rows (the kit of 9ee7a82 measured accuracy at batch 2 only; batch 1 ran "
                "on the H100 in the one-rank timings without a comparison)")


def head_dim_class(qk_head_dim: int, v_head_dim: int) -> str:
    widest = max(qk_head_dim, v_head_dim)
    return "<=128" if widest <= 128 else "<=256" if widest <= 256 else ">256"


def layer_kinds(mask: str, packed: bool) -> frozenset[str]:
    """The call kinds the block planner makes for a layer (Note [kernel calls]): full blocks
    always; square causal diagonal blocks when causal; bands, cut edges (and causal pieces of a
    window unbounded on the left) with a window; several sequences per call (``multi``) unless
    the layer is one dense sequence without a mask. tests/test_measured_kernels.py checks this
    against :func:`megatron_startrail.layout.plan_calls`."""
    kinds = {"none": {"full"}, "causal": {"full", "causal"}, "window": {"full", "causal", "band", "cut_edge"}}[mask]
    return frozenset(kinds | ({"multi"} if packed or mask != "none" else set()))


@dataclass(frozen=True)
class ClassRule:
    """One kernel for the classes it names (each field a tuple of values, or ANY)."""

    kernel: str
    dtypes: tuple[str, ...]
    head_dims: tuple[str, ...] | object
    masks: tuple[str, ...] | object
    packed: tuple[bool, ...] | object
    batches: tuple[str, ...] | object
    reason: str

    def matches(self, dtype: str, batch: str, mask: str, packed: bool, head_dims: str) -> bool:
        return all(allowed is ANY or value in allowed for value, allowed in (
            (dtype, self.dtypes), (batch, self.batches), (mask, self.masks), (packed, self.packed),
            (head_dims, self.head_dims)))


@dataclass(frozen=True)
class DeviceTable:
    name: str
    measured: bool  # False: no GPU table of this device is committed; the order is a conservative guess
    rules: tuple[ClassRule, ...]  # auto's order
    left_out: tuple[ClassRule, ...]  # kernels auto does not pick for these classes, and why


# --- what the H100 showed (H100 2026-11-27, on 9ee7a82) -------------------------------------

_EFFICIENT_HALF_BATCH = ClassRule(
    "torch_cuda_efficient", HALF, ANY, ANY, ANY, (">1",),
    "torch_cuda_efficient is left out in half precision at batch > 1 until a GPU confirms the fixed adapter: "
    "wrong dQ/dK on the H100 (bf16 batch 2: dQ 0.36, dK 0.25 relative error vs float64; square causal 1000 x 1000: "
    f"dQ 2.1, dK 1.5; {ACCURACY}, {EXPERIMENT})")
_EFFICIENT_MASKED = ClassRule(
    "torch_cuda_efficient", ("bf16", "fp16", "fp32"), ANY, ("causal", "window"), ANY, ANY,
    "torch_cuda_efficient is left out for masked layers until a GPU confirms the fixed adapter: every masked call "
    "(causal, band, cut edge) raised on the H100, 'attn_bias is not correctly aligned (strideM). "
    f"attn_bias.stride(2) = 1005' ({ACCURACY})")
_EFFICIENT_UNMEASURED = (
    ClassRule("torch_cuda_efficient", HALF, ANY, ANY, ANY, ("1",),
              "torch_cuda_efficient is not picked in half precision on sm90: cuDNN and FlashAttention serve there, "
              "and it was measured at batch 1 only in one-sequence bf16 calls (dQ 4.8e-3, head dims unrecorded; "
              f"{EXPERIMENT}), not at head dims over 256"),
    ClassRule("torch_cuda_efficient", ("fp32",), (">256",), ANY, ANY, ANY,
              "torch_cuda_efficient is unmeasured at head dims over 256 (the H100's float32 rows are 128/128 and "
              f"192/128; {ACCURACY})"),
)
_CUDNN_VARLEN = ClassRule(
    "torch_cuda_cudnn_varlen", HALF, ANY, ANY, ANY, ANY,
    "torch_cuda_cudnn_varlen: cuDNN's ragged op (packed documents in one launch) gave wrong dQ and dK on the H200 "
    "(benchmarks/results/gpu/h200-2026-11-28/README.md), so it is off and the kernel runs per-sequence cuDNN launches, "
    "1.62 ms against torch_cuda_flash's 1.52 on 4 documents in 8192 tokens there; it enters auto for packed "
    "layers when a committed GPU table shows it PASS and faster than torch_cuda_flash; "
    "--startrail-kernel torch_cuda_cudnn_varlen forces it")
_UNMEASURED_FLASH_ATTN = tuple(ClassRule(
    name, HALF, ANY, ANY, ANY, ANY,
    f"{name} is unmeasured on sm90 (not installed on the H100 of 2026-11-27: SKIP rows in {ACCURACY}); "
    f"it enters auto when a committed GPU table shows it PASS; --startrail-kernel {name} forces it")
    for name in ("flash_attn_3", "flash_attn"))

SM90 = DeviceTable("sm90 (H100/H200)", True, (
    ClassRule("torch_cuda_cudnn", HALF, ("<=128",), ("none", "causal"), (False,), ANY,
              "torch_cuda_cudnn: fwd+bwd causal 1x16x8192x128 bf16 2.58 ms vs torch_cuda_flash 3.72 ms (full: 3.96 vs "
              f"6.44 ms; {TIMING}), one rank P8 C2 at 128K 66.6 vs 101.9 ms ({NOTES}), "
              "H100 2026-11-27; PASS in every bf16/fp16 row at head dims 128/128 (no mask, causal, band, cut edge; MHA "
              f"and GQA; batch 2; {ACCURACY}); {BATCH_1_NOTE}"),
    ClassRule("torch_cuda_flash", HALF, ("<=128", "<=256"), ANY, ANY, ANY,
              "torch_cuda_flash: one launch per variable-length call, windows native; PASS in every bf16/fp16 row at "
              "head dims 128/128 and 192/128 (no mask, causal, band, cut edge; MHA and GQA; batch 2; "
              f"{ACCURACY}); fwd+bwd causal 1x16x8192 bf16 3.72 ms at 128/128, 5.87 ms at 192/128 "
              f"({TIMING}); it serves packed documents, windows and head dims over 128, where "
              "the cuDNN adapter loops over a call's sequences with a [sq, sk] bias (its speed there unmeasured) or "
              f"takes nothing (head dims up to 128: SKIP rows); {BATCH_1_NOTE}"),
    ClassRule("torch_cuda_efficient", ("fp32",), ("<=128", "<=256"), ("none",), ANY, ANY,
              "torch_cuda_efficient: the only fused kernel for float32; PASS in float32 without a mask at head dims "
              f"128/128 and 192/128, batch 2, MHA and GQA (dQ 2e-6; {ACCURACY}); float32 batch 1 one sequence: "
              f"2e-6 ({EXPERIMENT}); {BATCH_1_NOTE}"),
), (_EFFICIENT_HALF_BATCH, _EFFICIENT_MASKED, *_UNMEASURED_FLASH_ATTN, *_EFFICIENT_UNMEASURED, _CUDNN_VARLEN))

_GUESS = ("unmeasured on this device (no GPU table of it is committed: no A100 run yet), so a conservative order: "
          "9ee7a82's less what the H100 showed wrong")
UNMEASURED = DeviceTable("unmeasured (sm80 A100 and others)", False, (
    ClassRule("flash_attn", HALF, ("<=128", "<=256"), ANY, ANY, ANY,
              f"flash_attn: {_GUESS}; FlashAttention-2 is the kernel sm80 was built for (its adapter is unmeasured on "
              f"every GPU so far: SKIP rows in {ACCURACY})"),
    ClassRule("torch_cuda_flash", HALF, ("<=128", "<=256"), ANY, ANY, ANY,
              f"torch_cuda_flash: {_GUESS}; PASS in every bf16/fp16 row on the H100 ({ACCURACY})"),
    ClassRule("torch_cuda_efficient", ("fp32",), ANY, ("none",), ANY, ANY,
              f"torch_cuda_efficient: {_GUESS}; PASS in float32 without a mask on the H100 ({ACCURACY})"),
    ClassRule("torch_cuda_efficient", HALF, ANY, ("none",), ANY, ("1",),
              f"torch_cuda_efficient: {_GUESS}; right at batch 1 in one-sequence bf16 calls on the H100 (dQ 4.8e-3; "
              f"{EXPERIMENT})"),
), (_EFFICIENT_HALF_BATCH, _EFFICIENT_MASKED, _CUDNN_VARLEN))


def follows_sm90(capability: tuple[int, int] | None) -> bool:
    """An unmeasured GPU of compute capability 9 or more (sm100 B200/GB200, sm120, ...): it takes
    the sm90 table rather than the A100-class guess."""
    return capability is not None and tuple(capability) != (9, 0) and tuple(capability) >= (9, 0)


def _following_sm90(capability: tuple[int, int]) -> DeviceTable:
    sm = f"sm{capability[0]}{capability[1]}"
    why = (f"{sm} is unmeasured (no committed GPU table of it), so it follows the sm90 (H100) table, cuDNN first, "
           "as Transformer Engine ranks cuDNN on Hopper and Blackwell alike; ")

    def moved(rule: ClassRule) -> ClassRule:
        return ClassRule(rule.kernel, rule.dtypes, rule.head_dims, rule.masks, rule.packed, rule.batches,
                         why + rule.reason)

    return DeviceTable(f"sm90 (followed by the unmeasured {sm})", False, tuple(map(moved, SM90.rules)),
                       tuple(map(moved, SM90.left_out)))


def device_table(capability: tuple[int, int] | None) -> DeviceTable:
    """The table of a GPU of this compute capability (None: not known): sm90's for an H100/H200
    and, unmeasured, for any newer GPU (:func:`follows_sm90`); the conservative one otherwise."""
    if capability is not None and tuple(capability) == (9, 0):
        return SM90
    return _following_sm90(tuple(capability)) if follows_sm90(capability) else UNMEASURED


TABLES = (SM90, UNMEASURED, _following_sm90((10, 0)))
