"""Contract doubles of the torch CUDA attention ops the adapters call: what each op needs of its
arguments before it runs, as PyTorch's sources give it and an H100 showed (issue 49;
torch 2.11, ``../shared/gpu/h100-2026-11-27``). Nothing computes here: :class:`OpContracts` is a
dispatch mode that checks an op's arguments and then lets the op's meta / fake kernel give
the shapes. A broken contract raises :class:`ContractViolation` naming the op and the rule.

One checker per op (``CONTRACTS``):

- ``_flash_attention_forward`` / ``_backward`` (FlashAttention-2's ``mha_varlen_fwd`` / ``_bwd``):
  ``[total, h, d]`` half precision with a dense last dim, one head dim (a multiple of 8, at
  most 256), GQA by head groups, int32 ``cu_seqlens`` whose rows lie within the tensors
  (where the rehearsal knows their values), lse ``[h, total_q]`` float32 in the backward.
- ``_scaled_dot_product_efficient_attention`` / ``_backward`` (xFormers' cutlass kernel behind
  ``_efficient_attention_forward`` / ``_backward``): ``[B, h, s, d]``, one head count (the
  backward checks q, k, v heads equal), q/k one head dim; where q/k/v strides pick the aligned
  kernel (head strides a multiple of 8 in half, 4 in fp32) every batch / head / row stride
  of q, k, v and the additive bias must be a multiple of it (``check_supported``: "attn_bias
  is not correctly aligned (strideM)", seen on the H100 with an expanded ``[sq, 1005]`` mask).
  The half-precision backward reads out's rows at a stride of ``h * dv`` whatever the tensor's
  is (``kernel_backward.h``: ``o_strideM()``; PyTorch passes out's batch and head strides
  only): out must be laid out so, dout like out, lse ``[B, h, ceil(sq / 32) * 32]`` float32 as
  the forward returned it.
- ``_scaled_dot_product_cudnn_attention`` / ``_backward``: ``[B, h, s, d]`` half precision, one
  head dim (the adapter pads), one head count where an attn_bias goes in, else K/V heads dividing
  q's (GQA; an H100 probe, 2026-11-28), dout laid out like out (cuDNN
  otherwise copies it, with a warning), lse ``[B, h, sq, 1]`` as the forward returned it, and
  ``max_q`` / ``max_k`` the tensors' rows (the backward sizes its graph from them).
- ``_cudnn_attention_forward`` / ``_backward`` with ``cum_seq_q`` / ``_k`` (cuDNN's ragged
  layout, ``build_graph_and_tensors_nestedtensor`` in PyTorch's ``MHA.cpp``; what torch 2.13's
  ``nn.attention.varlen`` calls with its cuDNN switch on): ``[total, h, d]`` half precision in
  dense rows (torch's varlen made them ``.contiguous()``: the ragged offsets count whole rows),
  one head count (that varlen refuses GQA on cuDNN), one head dim (a multiple of 8, at most 128),
  no ``attn_bias`` ("attn_bias not yet supported with cuDNN Attention and NestedTensor"), int32
  ``cum_seq`` within the tensors; the forward returns out ``[total_q, h, d]`` and lse
  ``[total_q, h, 1]`` float32 (``at::empty({q.size(0), h_q, 1})``), which the backward takes
  as returned, with grad_out laid out like out. These ops have no meta kernel in torch 2.13:
  :func:`register_ragged_cudnn_meta` gives them one (shapes as above) for the meta device and
  fake tensors.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

aten = torch.ops.aten
HALF = (torch.float16, torch.bfloat16)


class ContractViolation(AssertionError):
    pass


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _need(ok: bool, op: str, rule: str) -> None:
    if not ok:
        raise ContractViolation(f"{op}: {rule}")


def _named(func, args, kwargs) -> dict:
    """The op's arguments by schema name (defaults filled in)."""
    named = {}
    for i, a in enumerate(func._schema.arguments):
        if i < len(args):
            named[a.name] = args[i]
        elif a.name in kwargs:
            named[a.name] = kwargs[a.name]
        else:
            named[a.name] = a.default_value if a.has_default_value() else None
    return named


def _same_layout(a, b) -> bool:
    """One memory layout: equal strides on every dim longer than 1 (a size-1 dim's stride is never used)."""
    return a.shape == b.shape and all(x == y for n, x, y in zip(a.shape, a.stride(), b.stride()) if n > 1)


def _out_and_grad(op, out, dout, shape, dtype) -> None:
    """out and grad_out of ``shape`` and ``dtype``, laid out alike."""
    for name, t in (("out", out), ("grad_out", dout)):
        _need(tuple(t.shape) == tuple(shape) and t.dtype == dtype, op, f"{name} {list(t.shape)} {t.dtype} must be "
              f"{list(shape)} {dtype}")
    _need(_same_layout(dout, out), op, f"grad_out strides {dout.stride()} must be out's {out.stride()}")


def _dense_last(op, **tensors) -> None:
    for name, t in tensors.items():
        _need(t.stride(-1) == 1, op, f"{name} {list(t.shape)} needs a dense last dim, strides {t.stride()}")


# --- FlashAttention-2 (variable length) ----------------------------------------------------------

def _flash_common(op, a, known) -> None:
    q, k, v = a["query"], a["key"], a["value"]
    _need(a["cum_seq_q"] is not None, op, "the adapters call the variable-length form (cum_seq_q given)")
    for name, t in (("query", q), ("key", k), ("value", v)):
        _need(t.dim() == 3, op, f"{name}: varlen takes [total, heads, head dim], got {list(t.shape)}")
        _need(t.dtype in HALF and t.dtype == q.dtype, op, f"{name}: one half-precision dtype, got {t.dtype}")
    _dense_last(op, query=q, key=k, value=v)
    d = q.shape[-1]
    _need(d % 8 == 0 and d <= 256, op, f"head dim {d}: a multiple of 8, at most 256")
    _need(k.shape[-1] == d and v.shape == k.shape, op, f"q {list(q.shape)}, k {list(k.shape)}, v "
          f"{list(v.shape)}: one head dim, k and v one shape")
    _need(q.shape[1] % k.shape[1] == 0, op, f"k heads {k.shape[1]} must divide q heads {q.shape[1]}")
    _cumulative_lengths(op, a, known, q.shape[0], k.shape[0], "cu_seqlens_", "max_seqlen_")


def _cumulative_lengths(op, a, known, q_rows: int, k_rows: int, prefix: str, max_prefix: str) -> None:
    """``cum_seq_q`` / ``_k``: contiguous 1-D int32 of one batch; where the values are known, rising
    from 0, within the tensors' rows, no sequence longer than ``max_q`` / ``max_k``."""
    for side, cu, rows, longest in (("q", a["cum_seq_q"], q_rows, a["max_q"]), ("k", a["cum_seq_k"], k_rows,
                                                                                  a["max_k"])):
        _need(cu.dtype == torch.int32 and cu.dim() == 1 and cu.is_contiguous(), op,
              f"{prefix}{side}: contiguous 1-D int32")
        values = known(cu)
        if values is None:
            continue
        _need(values[0] == 0 and all(y >= x for x, y in zip(values, values[1:])), op,
              f"{prefix}{side} must rise from 0")
        _need(values[-1] <= rows, op, f"{prefix}{side} ends at row {values[-1]}, the tensor holds {rows} rows")
        _need(longest >= max(y - x for x, y in zip(values, values[1:])), op, f"{max_prefix}{side} {longest} "
              "is shorter than a sequence")
    _need(a["cum_seq_k"].numel() == a["cum_seq_q"].numel(), op, f"{prefix}q and _k: one batch")


def flash_forward(a, known) -> None:
    _flash_common("aten._flash_attention_forward", a, known)


def flash_backward(a, known) -> None:
    op = "aten._flash_attention_backward"
    _flash_common(op, a, known)
    q, lse = a["query"], a["logsumexp"]
    for name in ("grad_out", "out"):
        t = a[name]
        _need(t.shape == q.shape and t.dtype == q.dtype, op, f"{name} {list(t.shape)} {t.dtype} must be q's "
              f"{list(q.shape)} {q.dtype}")
    _need(lse.dtype == torch.float32 and tuple(lse.shape) == (q.shape[1], q.shape[0]) and lse.is_contiguous(),
          op, f"logsumexp {list(lse.shape)} {lse.dtype}: contiguous [heads, total_q] float32")


# --- memory-efficient (xFormers cutlass) ---------------------------------------------------------

def _alignment(q, k, v) -> int:
    """The alignment the op's kernel choice lands on: the aligned kernels (16-byte: 8 half, 4 fp32
    elements) when every head stride and head dim allows them, else the unaligned ones (1)."""
    align = 8 if q.dtype in HALF else 4
    ok = all(t.stride(1) % align == 0 and t.shape[-1] % align == 0 for t in (q, k, v))
    return align if ok else 1


def _strides_aligned(op, name, t, align, batch, heads, rows) -> None:
    # check_supported: strideB when batch > 1, strideH when heads > 1, strideM (bias: when rows > 1)
    for what, stride, applies in (("strideB", t.stride(0), batch > 1), ("strideH", t.stride(1), heads > 1),
                                  ("strideM", t.stride(2), rows > 1)):
        _need(not applies or stride % align == 0, op, f"{name} is not correctly aligned ({what}). {name}.stride"
              f"({'BHM'.index(what[-1])}) = {stride}, and should be a multiple of {align}")
    _need(t.storage_offset() % align == 0, op, f"{name}: data pointer not aligned to {align} elements")


def _efficient_common(op, a) -> int:
    q, k, v, bias = a["query"], a["key"], a["value"], a["attn_bias"]
    for name, t in (("query", q), ("key", k), ("value", v)):
        _need(t.dim() == 4, op, f"{name}: [batch, heads, seq, head dim], got {list(t.shape)}")
        _need(t.dtype in HALF + (torch.float32,) and t.dtype == q.dtype, op, f"{name}: one dtype of "
              f"half/bf16/fp32, got {t.dtype}")
    _dense_last(op, query=q, key=k, value=v)
    b, h, sq, _ = q.shape
    _need(k.shape[0] == b == v.shape[0] and k.shape[1] == h == v.shape[1], op, f"q {list(q.shape)}, k "
          f"{list(k.shape)}, v {list(v.shape)}: one batch and one head count (no GQA)")
    _need(k.shape[2] == v.shape[2] and k.shape[3] == q.shape[3], op, "k and v one length, q and k one head dim")
    align = _alignment(q, k, v)
    for name, t in (("query", q), ("key", k), ("value", v)):
        _strides_aligned(op, name, t, align, b, h, 2)
    if bias is not None:
        _need(tuple(bias.shape) == (b, h, sq, k.shape[2]) and bias.dtype == q.dtype, op,
              f"attn_bias {list(bias.shape)} {bias.dtype} must be [{b}, {h}, {sq}, {k.shape[2]}] {q.dtype}")
        _need(bias.stride(3) == 1, op, "attn_bias: wrong alignment (last dimension must be contiguous)")
        _strides_aligned(op, "attn_bias", bias, align, b, h, sq)
    return align


def efficient_forward(a, known) -> None:
    _efficient_common("aten._scaled_dot_product_efficient_attention", a)


def efficient_backward(a, known) -> None:
    op = "aten._scaled_dot_product_efficient_attention_backward"
    _efficient_common(op, a)
    q, v, out, dout, lse = a["query"], a["value"], a["out"], a["grad_out_"], a["logsumexp"]
    b, h, sq, _ = q.shape
    dv = v.shape[-1]
    if q.dtype in HALF and sq > 1:
        _need(out.stride(2) == h * dv, op, f"out {list(out.shape)} strides {out.stride()}: the half-precision "
              f"kernel reads out's rows {h * dv} (heads x head dim) apart, whatever its row stride (here "
              f"{out.stride(2)}): rowsum(dO * O) and so dQ, dK come out wrong")
    _out_and_grad(op, out, dout, (b, h, sq, dv), q.dtype)
    _dense_last(op, out=out)
    _need(lse.dtype == torch.float32 and tuple(lse.shape) == (b, h, _round_up(sq, 32)) and lse.is_contiguous(),
          op, f"logsumexp {list(lse.shape)} {lse.dtype}: contiguous [{b}, {h}, {_round_up(sq, 32)}] float32, as "
          "the forward returned it")
    _need(not a["grad_input_mask"][3], op, "no attn_bias gradient (its own alignment rules)")


# --- cuDNN ----------------------------------------------------------------------------------------

def _cudnn_common(op, a) -> None:
    q, k, v, bias = a["query"], a["key"], a["value"], a["attn_bias"]
    for name, t in (("query", q), ("key", k), ("value", v)):
        _need(t.dim() == 4 and t.dtype in HALF and t.dtype == q.dtype, op, f"{name}: [batch, heads, seq, head "
              f"dim] in one half-precision dtype, got {list(t.shape)} {t.dtype}")
    _dense_last(op, query=q, key=k, value=v)
    # K/V heads may divide q's (GQA) where no bias goes in: the H100 probe of 2026-11-28
    # (benchmarks/results/gpu/h100-2026-11-28/probe_cudnn_gqa.txt) ran that right; with a bias, unmeasured.
    gqa_ok = bias is None and k.shape[1] == v.shape[1] and q.shape[1] % k.shape[1] == 0
    _need(q.shape[0] == k.shape[0] == v.shape[0] and (q.shape[1] == k.shape[1] == v.shape[1] or gqa_ok)
          and k.shape[2] == v.shape[2], op, f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}: one batch "
          "and head count (K/V heads dividing q's only without attn_bias), k and v one length")
    d = q.shape[-1]
    _need(k.shape[-1] == d == v.shape[-1] and d % 8 == 0 and d <= 128, op, f"head dims {d}, {k.shape[-1]}, "
          f"{v.shape[-1]}: one, a multiple of 8, at most 128")
    if bias is not None:
        _need(bias.dim() == 4 and bias.shape[0] == q.shape[0] and bias.shape[2:] == (q.shape[2], k.shape[2])
              and bias.stride(-1) == 1, op, f"attn_bias {list(bias.shape)}: [batch, heads or 1, sq, sk], dense "
              "last dim")


def cudnn_forward(a, known) -> None:
    _cudnn_common("aten._scaled_dot_product_cudnn_attention", a)


def _dim_order(t) -> tuple[int, ...]:
    """``t``'s dims from the outermost in memory to the innermost (dims of size 1 left out)."""
    return tuple(sorted((i for i in range(t.dim()) if t.shape[i] > 1), key=lambda i: -t.stride(i)))


def cudnn_backward(a, known) -> None:
    op = "aten._scaled_dot_product_cudnn_attention_backward"
    _cudnn_common(op, a)
    q, k, out, dout, lse = a["query"], a["key"], a["out"], a["grad_out"], a["logsumexp"]
    _out_and_grad(op, out, dout, q.shape, q.dtype)
    # The forward gives out q's dim order; on the H200 (2026-11-28, cuDNN 9.19) out and dO made
    # contiguous [B, h, s, d] with q in [s, b, h, d] order gave GQA wrong dQ, dK, dV.
    _need(_dim_order(out) == _dim_order(q), op, f"out strides {out.stride()} must keep q's dim order "
          f"(q strides {q.stride()}), as the forward returned it")
    _need(lse.dtype == torch.float32 and tuple(lse.shape) == (*q.shape[:3], 1), op, f"logsumexp "
          f"{list(lse.shape)}: [{', '.join(map(str, q.shape[:3]))}, 1] float32, as the forward returned it")
    _need((a["max_q"], a["max_k"]) == (q.shape[2], k.shape[2]), op, f"max_q, max_k {a['max_q']}, {a['max_k']} "
          f"must be the rows of q and k ({q.shape[2]}, {k.shape[2]})")


# --- cuDNN, ragged (variable length) ---------------------------------------------------------------

def _ragged_common(op, a, known) -> None:
    q, k, v = a["query"], a["key"], a["value"]
    _need(a["cum_seq_q"] is not None and a["cum_seq_k"] is not None, op, "the adapter calls the ragged form "
          "(cum_seq_q and cum_seq_k given)")
    for name, t in (("query", q), ("key", k), ("value", v)):
        _need(t.dim() == 3 and t.dtype in HALF and t.dtype == q.dtype, op, f"{name}: [total, heads, head dim] in "
              f"one half-precision dtype, got {list(t.shape)} {t.dtype}")
        _need(t.is_contiguous(), op, f"{name} {list(t.shape)} strides {t.stride()}: dense rows (the ragged offsets "
              "count whole rows of heads x head dim)")
    _need(q.shape[1] == k.shape[1] == v.shape[1], op, f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}: "
          "one head count (no GQA on cuDNN's ragged path)")
    _need(k.shape[0] == v.shape[0], op, "k and v one length")
    d = q.shape[-1]
    _need(k.shape[-1] == d == v.shape[-1] and d % 8 == 0 and d <= 128, op, f"head dims {d}, {k.shape[-1]}, "
          f"{v.shape[-1]}: one, a multiple of 8, at most 128")
    _need(a["attn_bias"] is None, op, "attn_bias not yet supported with cuDNN Attention and NestedTensor")
    _cumulative_lengths(op, a, known, q.shape[0], k.shape[0], "cum_seq_", "max_")


def ragged_cudnn_forward(a, known) -> None:
    op = "aten._cudnn_attention_forward"
    _ragged_common(op, a, known)
    _need(a["compute_log_sumexp"], op, "compute_log_sumexp: the schedule merges with the lse")


def ragged_cudnn_backward(a, known) -> None:
    op = "aten._cudnn_attention_backward"
    _ragged_common(op, a, known)
    q, out, dout, lse = a["query"], a["out"], a["grad_out"], a["logsumexp"]
    _out_and_grad(op, out, dout, q.shape, q.dtype)
    _need(out.is_contiguous(), op, f"out strides {out.stride()}: dense rows, as the forward returned it")
    _need(lse.dtype == torch.float32 and tuple(lse.shape) == (q.shape[0], q.shape[1], 1) and lse.is_contiguous(),
          op, f"logsumexp {list(lse.shape)} {lse.dtype}: contiguous [{q.shape[0]}, {q.shape[1]}, 1] float32, as "
          "the forward returned it")


_RAGGED_META = []  # the Library objects (kept alive: dropping one removes its kernels)


def register_ragged_cudnn_meta() -> None:
    """Meta kernels for the ragged cuDNN ops (torch 2.13 has none), shaped as ``attention.cu`` allocates:
    out like q with v's head dim, lse ``[total_q, h, 1]`` float32; the backward's grads like q, k, v."""
    if _RAGGED_META:
        return
    lib = torch.library.Library("aten", "IMPL", "Meta")

    def forward(query, key, value, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, compute_log_sumexp,
                dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
        total, heads = query.shape[0], query.shape[1]
        out = query.new_empty((total, heads, value.shape[-1]))
        lse = query.new_empty((total, heads, 1), dtype=torch.float32)
        rng = query.new_empty((), dtype=torch.int64)
        return (out, lse, cum_seq_q, cum_seq_k, max_q, max_k, rng, rng.clone(),
                query.new_empty((0,)))

    def backward(grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias, cum_seq_q,
                 cum_seq_k, max_q, max_k, dropout_p, is_causal, *, scale=None):
        return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)

    lib.impl("_cudnn_attention_forward", forward)
    lib.impl("_cudnn_attention_backward", backward)
    _RAGGED_META.append(lib)


CONTRACTS = {
    aten._flash_attention_forward.default: flash_forward,
    aten._flash_attention_backward.default: flash_backward,
    aten._scaled_dot_product_efficient_attention.default: efficient_forward,
    aten._scaled_dot_product_efficient_attention_backward.default: efficient_backward,
    aten._scaled_dot_product_cudnn_attention.default: cudnn_forward,
    aten._scaled_dot_product_cudnn_attention_backward.default: cudnn_backward,
    aten._cudnn_attention_forward.default: ragged_cudnn_forward,
    aten._cudnn_attention_backward.default: ragged_cudnn_backward,
}


class OpContracts(TorchDispatchMode):
    """Checks every op of :data:`CONTRACTS` before it runs; ``known(tensor)`` gives a device integer
    tensor's values as a CPU tensor where the rehearsal follows them (None: unknown, the value
    rules are skipped).
    ``checked`` counts the checks per op."""

    def __init__(self, known=lambda t: None, checked: dict | None = None) -> None:
        super().__init__()
        register_ragged_cudnn_meta()
        self.known = known
        self.checked: dict[str, int] = {} if checked is None else checked

    def _values(self, t) -> list | None:
        with _disable_current_modes():  # the known values are real CPU tensors: read outside the modes
            known = self.known(t)
            return None if known is None else known.tolist()

    def check(self, func, args, kwargs) -> None:
        """Checks one op's arguments (nothing for an op without a contract); for a dispatch mode of
        one's own to call (the rehearsal's :class:`~.rank.DeviceRules`: no second mode per op)."""
        contract = CONTRACTS.get(func)
        if contract is not None:
            contract(_named(func, args, kwargs), self._values)
            self.checked[str(func)] = self.checked.get(str(func), 0) + 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.check(func, args, kwargs)
        return func(*args, **kwargs)
