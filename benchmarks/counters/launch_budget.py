"""Kernel launches per layer on one rank: the ATen ops one StarTrail rank dispatches for one
layer's forward + backward, counted on CPU (GPU hot-path issue).

On a GPU every ATen op that computes is a kernel launch of 5-10 us; at long context the
attention math per block is short, so the ops *around* the block kernel decide whether a
layer spends its time computing or launching. This counts them without a GPU and without
the math: one process stands in for rank ``r`` of ``P`` (torch's no-op ``fake`` process
group: every collective and P2P returns at once), the tensors are on the ``meta`` device
(shapes only), and a ``TorchDispatchMode`` sees every ATen op. The block kernel is counted
as ONE op per call (on a GPU it is one fused launch): its own ops run with the mode off.

Columns: ``launch`` ops that launch work on a GPU (every op but views and bare
allocations), ``kernel`` block-kernel calls, ``comm`` collectives and P2P posts, ``all``
every dispatched op. The yardstick is a minimal zigzag ring, written the way
ring-flash-attention structures it (one fused call per half block, one merge per step),
counted the same way (in this file only; nothing of it is used by the package).

    .venv/bin/python -m benchmarks.counters.launch_budget                  # 131072 tokens, the table
    .venv/bin/python -m benchmarks.counters.launch_budget --json out.json  # and the rows as JSON
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
from collections import Counter

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from megatron_startrail import attention as attention_module
from megatron_startrail import kernels as kernel_module
from megatron_startrail import nccl_rules
from megatron_startrail import new_startrail_groups, startrail_attn
from megatron_startrail.documents import agree_on_documents
from megatron_startrail.comm import CommStats
from megatron_startrail.kernels.padding import EqualHeadDimsKernel

# Ops that allocate or re-describe memory without launching anything on a GPU.
_NO_LAUNCH = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "detach", "lift_fresh",
              "_local_scalar_dense", "set_", "resize_", "record_stream", "wait_tensor"}


# The fused attention ops the CUDA adapters call: with ``--kernel torch_cuda_*`` each is one
# kernel launch, and every other op inside the adapter counts as the adapter's own.
_ATTENTION_OPS = {"_flash_attention_forward", "_flash_attention_backward", "_scaled_dot_product_cudnn_attention",
                  "_scaled_dot_product_cudnn_attention_backward", "_scaled_dot_product_efficient_attention",
                  "_scaled_dot_product_efficient_attention_backward"}


@dataclasses.dataclass
class Counts:
    launch: int = 0
    kernel: int = 0
    comm: int = 0
    all: int = 0
    by_op: Counter = dataclasses.field(default_factory=Counter)
    # Bytes the non-kernel, non-communication ops read + write (every tensor argument and
    # result of a launching op, at its view's size; an index op at its rows: _moved_bytes): the schedule's (merges, copies, casts,
    # gathers) and, with a CUDA adapter, the adapter's own (pads, transposes, contiguous
    # copies, GQA expansion) apart.
    bytes: int = 0
    adapter_launch: int = 0
    adapter_bytes: int = 0
    kernel_bytes: int = 0  # the attention calls' operands and results, for scale
    # The same ops' bytes as the memory sees them (:func:`_touched_bytes`): a destination that is
    # only written counted once, an index op at the rows it gathers or scatters.
    touched: int = 0
    adapter_touched: int = 0
    by_op_bytes: Counter = dataclasses.field(default_factory=Counter)
    in_adapter: bool = False
    # With ``sites`` set: the same bytes (schedule and adapter) by ``op file:line (function)``,
    # the innermost frame of the package that issued the op (where a change would cut them).
    sites: bool = False
    by_site_bytes: Counter = dataclasses.field(default_factory=Counter)


def _tensor_bytes(tree) -> int:
    """Bytes of every tensor in ``tree`` (nested lists / tuples / dicts), each at its view's size."""
    leaves = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, (list, tuple)) else [tree]
    total = 0
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            total += leaf.numel() * leaf.element_size()
        elif isinstance(leaf, (list, tuple, dict)):
            total += _tensor_bytes(leaf)
    return total


# In-place ops that write their first argument without reading it (the bytes column counts
# every argument as read and the result as written: these destinations twice).
_WRITE_ONLY = {"copy_", "zero_", "fill_", "index_copy_", "index_fill_", "masked_fill_"}


_INDEX_OPS = ("index_select", "index_copy_", "index_add_")


def _index_op_bytes(name: str, args, result, *, written_once: bool) -> int:
    """An index op at the rows it gathers or scatters (a GPU kernel visits the index, not the tensor
    it indexes into): ``index_select`` reads its result's rows of the source and writes them;
    ``index_add_`` reads and writes the source's rows of the destination and reads the source;
    ``index_copy_`` the same, its destination rows counted once if ``written_once`` (they are only
    written), else read and written as :func:`_moved_bytes` counts ``copy_``. The index is read."""
    if name == "index_select":
        return 2 * _tensor_bytes(result) + _tensor_bytes(args[2])
    destination = 1 if name == "index_copy_" and written_once else 2
    return (destination + 1) * _tensor_bytes(args[3]) + _tensor_bytes(args[2])


def _moved_bytes(name: str, args, kwargs, result) -> int:
    """The ``schedule GB`` rule: every tensor argument read and the result written, each at its
    view's size -- except the index ops, at their rows (:func:`_index_op_bytes`; charging the whole
    destination made a call that gathers 8192 rows of a 32768-row accumulator cost four times its
    rows). :func:`_touched_bytes` counts a destination only written once."""
    if name in _INDEX_OPS:
        return _index_op_bytes(name, args, result, written_once=False)
    return _tensor_bytes(args) + _tensor_bytes(kwargs or {}) + _tensor_bytes(result)


def _touched_bytes(name: str, args, kwargs, result) -> int:
    """Bytes the op reads and writes in memory: ``index_select`` reads the rows it gathers (its
    result's size), ``index_copy_`` / ``index_add_`` write (and, adding, read) the rows of their
    source's size; a destination only written (``copy_``, ``zero_``, an ``out=``) is counted once."""
    if name in _INDEX_OPS:
        return _index_op_bytes(name, args, result, written_once=True)
    written = _tensor_bytes(result)
    if name in _WRITE_ONLY:
        return written + _tensor_bytes(args[1:])
    if kwargs and "out" in kwargs:
        return written + _tensor_bytes(args) + _tensor_bytes({k: v for k, v in kwargs.items() if k != "out"})
    return _tensor_bytes(args) + _tensor_bytes(kwargs or {}) + written


class _OpCounter(TorchDispatchMode):
    def __init__(self, counts: Counts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        namespace = func.namespace
        counts = self.counts
        counts.all += 1
        result = func(*args, **(kwargs or {}))
        if namespace == "c10d":
            counts.comm += 1
            counts.launch += 1
        elif name in _ATTENTION_OPS:
            counts.kernel += 1
            counts.launch += 1
            counts.kernel_bytes += _tensor_bytes(args) + _tensor_bytes(result)
        elif not func.is_view and name not in _NO_LAUNCH:
            moved = _moved_bytes(name, args, kwargs, result)
            counts.launch += 1
            counts.by_op[f"{namespace}.{name}"] += 1
            touched = _touched_bytes(name, args, kwargs, result)
            if counts.in_adapter:
                counts.adapter_launch += 1
                counts.adapter_bytes += moved
                counts.adapter_touched += touched
                counts.by_op_bytes[f"adapter {namespace}.{name}"] += moved
            else:
                counts.bytes += moved
                counts.touched += touched
                counts.by_op_bytes[f"{namespace}.{name}"] += moved
            if counts.sites:
                counts.by_site_bytes[f"{name} {_issuing_site()}"] += moved
        return result


def _issuing_site() -> str:
    """``file:line (function)`` of the innermost frame in ``megatron_startrail`` on the stack, past
    the package's own torch modes (``CudaToCpuMode``, installed by tests with Megatron: the line
    that issued the op is the frame below them)."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if (f"{os.sep}megatron_startrail{os.sep}" in path
                and frame.f_code.co_name not in ("__torch_function__", "__torch_dispatch__")):
            return f"{os.path.basename(path)}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "outside the package"


@contextlib.contextmanager
def kernel_calls_count_once(counts: Counts, kernel_classes):
    """Inside: every ``forward`` / ``backward`` of these kernel classes counts as one launch."""
    saved = []
    hidden = []
    for cls in kernel_classes:
        # The layer is counted on the fused kernels' path (flash: the schedule adds each call's
        # gradients itself), not on a per-sequence kernel's backward_into, which would fold
        # the accumulator adds into the counted call (blocks.backward_step).
        hidden.append((cls, cls.__dict__.get("backward_into")))
        cls.backward_into = None
        for method in ("forward", "backward"):
            original = getattr(cls, method)
            saved.append((cls, method, original))

            def wrapped(self, *args, _original=original, **kwargs):
                counts.kernel += 1
                counts.launch += 1
                counts.all += 1
                with _disable_current_modes():
                    result = _original(self, *args, **kwargs)
                counts.kernel_bytes += _tensor_bytes(args) + _tensor_bytes(result)
                return result

            setattr(cls, method, wrapped)
    try:
        yield
    finally:
        for cls, method, original in saved:
            setattr(cls, method, original)
        for cls, own in hidden:
            if own is None:
                del cls.backward_into
            else:
                cls.backward_into = own


@contextlib.contextmanager
def fake_rank(rank: int, world: int):
    """This process as rank ``rank`` of ``world`` on torch's no-op process group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: PLC0415 - test utility

    if dist.is_initialized():
        dist.destroy_process_group()
    # No NCCL-rules records (the test suite's mode): a no-op group's run checks nothing, and
    # records left in this process would reach the ranks a test forks from it later.
    rules, os.environ[nccl_rules.ENV] = os.environ.get(nccl_rules.ENV), "0"
    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
        if rules is None:
            del os.environ[nccl_rules.ENV]
        else:
            os.environ[nccl_rules.ENV] = rules


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    world: int  # P
    team: int  # C (0: the yardstick ring)
    tokens: int = 131072
    heads: int = 8
    kv_heads: int = 8
    head_dim: int = 128
    v_head_dim: int = 128
    causal: bool = True
    window: tuple[int, int] | None = None
    docs: str | None = None  # None, "sample" or "document": 64 log-normal documents per sample
    rotation: str = "auto"
    regather: bool = False
    halo: bool = True  # False: a window that fits a chunk runs the schedule anyway
    rank: int = 1
    kernel: str = "reference"  # or a CUDA adapter (torch_cuda_flash, torch_cuda_cudnn): its own ops apart
    max_logit: bool = False  # return_max_logit (--qk-clip / --log-max-attention-logit): the max-logit pass


def lognormal_documents(tokens: int, n_docs: int, cp: int, padded: bool, seed: int = 0):
    """``cu_seqlens`` (and ``cu_seqlens_padded`` for the document layout) of ``n_docs``
    log-normal lengths filling ``tokens``: int32 CPU tensors."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.empty(n_docs, dtype=torch.float64).log_normal_(0.0, 1.0, generator=gen)
    if padded:  # every padded span a multiple of 2 CP, the spans filling the sample
        unit = 2 * cp
        spans = [max(1, int(w / weights.sum() * tokens) // unit) * unit for w in weights.tolist()]
        spans[-1] += tokens - sum(spans)
        assert spans[-1] > 0
        lengths = [max(1, s - int(s * 0.1)) for s in spans]  # 10% padding per span
        cu_p = [0]
        for s in spans:
            cu_p.append(cu_p[-1] + s)
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        return torch.tensor(cu, dtype=torch.int32), torch.tensor(cu_p, dtype=torch.int32)
    lengths = [max(1, int(w / weights.sum() * tokens)) for w in weights.tolist()]
    lengths[-1] += tokens - sum(lengths)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32), None


def _inputs(case: Case, s_local: int):
    meta = torch.device("meta")
    q = torch.empty(s_local, 1, case.heads, case.head_dim, device=meta, dtype=torch.bfloat16, requires_grad=True)
    k = torch.empty(s_local, 1, case.kv_heads, case.head_dim, device=meta, dtype=torch.bfloat16, requires_grad=True)
    v = torch.empty(s_local, 1, case.kv_heads, case.v_head_dim, device=meta, dtype=torch.bfloat16,
                    requires_grad=True)
    dout = torch.empty(s_local, 1, case.heads, case.v_head_dim, device=meta, dtype=torch.bfloat16)
    return q, k, v, dout


def count_startrail(case: Case, sites: bool = False) -> Counts:
    """One rank's ops for one layer's forward + backward (meta tensors, fake process group);
    ``sites``: their bytes by issuing line too (``Counts.by_site_bytes``)."""
    counts = Counts(sites=sites)
    with fake_rank(case.rank, case.world):
        groups = new_startrail_groups(team_size=case.team, backward_rotation=case.rotation,
                                      regather_in_backward=case.regather, kernel="reference")
        q, k, v, dout = _inputs(case, case.tokens // case.world)
        extra = {}
        if case.docs is not None:
            cu, cu_p = lognormal_documents(case.tokens, 64, case.world, case.docs == "document")
            # The per-micro-batch agreement (one host sync) happens once per micro-batch, before
            # the layers: made here on CPU so that the meta layer finds it cached.
            agree_on_documents(cu, cu_p, q.shape[0], 1, groups, CommStats(), torch.device("cpu"))
            extra = {"cu_seqlens": cu, "cu_seqlens_padded": cu_p}
        with _kernel_counting(counts, case.kernel), _OpCounter(counts):
            out = startrail_attn(q, k, v, groups, causal=case.causal, window_size=case.window,
                                 halo_exchange=case.halo, return_max_logit=case.max_logit, **extra)
            out = out[0] if case.max_logit else out
            torch.autograd.grad(out, (q, k, v), dout)
    return counts


@contextlib.contextmanager
def _kernel_counting(counts: Counts, name: str):
    """The reference kernel: one op a call (its math unseen). A CUDA adapter (on meta: the
    fused ops' meta kernels give the shapes): the layer runs it, its fused op is the
    kernel launch and every other op inside it is counted as the adapter's own."""
    if name == "reference":
        with kernel_calls_count_once(counts, [kernel_module.ReferenceKernel]):
            yield
        return
    kernel = kernel_module.make_kernel(name)
    cls = type(kernel)
    # The adapter's forward and backward; and the padded backward a backward_into falls back on
    # (EqualHeadDimsKernel's own, past the entry's check), whose accumulator adds stay the
    # schedule's, as when the schedule adds a call's gradients itself.
    owners = [(cls, "forward"), (cls, "backward")]
    if issubclass(cls, EqualHeadDimsKernel):
        owners.append((EqualHeadDimsKernel, "backward"))
    saved = [(owner, method, owner.__dict__.get(method), getattr(owner, method)) for owner, method in owners]

    def inside(original):
        def wrapped(self, *args, **kwargs):
            outer, counts.in_adapter = counts.in_adapter, True
            try:
                return original(self, *args, **kwargs)
            finally:
                counts.in_adapter = outer
        return wrapped

    for owner, method, _, original in saved:
        setattr(owner, method, inside(original))
    chosen = attention_module.choose_layer_kernel  # the layer's choice (the reference kernel), this adapter run
    attention_module.choose_layer_kernel = lambda *args, **kwargs: dataclasses.replace(chosen(*args, **kwargs),
                                                                                      kernel=kernel)
    try:
        yield
    finally:
        attention_module.choose_layer_kernel = chosen
        for owner, method, own, _ in reversed(saved):
            if own is None:
                delattr(owner, method)
            else:
                setattr(owner, method, own)


# -- the yardstick: a minimal zigzag ring, ring-flash-attention's structure ---------------------


class _YardstickKernel:
    """One fused call: reference math on [b, h, s, d], counted once (like the block kernels)."""

    def forward(self, q, k, v, causal, scale):
        scores = (q.float() @ k.float().transpose(-1, -2)) * scale
        if causal:
            scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1),
                                        -math.inf)
        lse = scores.logsumexp(-1)
        return (scores - lse[..., None]).exp() @ v.float(), lse

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _update(out, lse, block_out, block_lse):
    # ring-flash-attention's update_out_and_lse: out - sigmoid(b_lse - lse) (out - b_out), lse - logsigmoid(lse - b_lse)
    block_lse = block_lse.unsqueeze(-1)
    new_out = out - torch.sigmoid(block_lse - lse) * (out - block_out)
    new_lse = lse - torch.nn.functional.logsigmoid(lse - block_lse)
    return new_out, new_lse


def count_yardstick(case: Case) -> Counts:
    """Zigzag ring attention on rank ``case.rank`` of ``case.world``: forward (one causal call,
    then per step one half-block call and one merge) and backward (per step one half-block
    backward, dQ added, dK dV accumulated and passed on), K and V passed by batched P2P."""
    counts = Counts()
    kernel = _YardstickKernel()
    with fake_rank(case.rank, case.world):
        world, rank = case.world, case.rank
        q, k, v, dout = (t.detach().permute(1, 2, 0, 3) for t in _inputs(case, case.tokens // world))
        half = q.shape[2] // 2
        scale = case.head_dim ** -0.5
        nxt, prv = (rank + 1) % world, (rank - 1) % world

        def p2p(send, recv):
            ops = [dist.P2POp(dist.isend, t, nxt) for t in send] + [dist.P2POp(dist.irecv, t, prv) for t in recv]
            return dist.batch_isend_irecv(ops)

        def ring(kk, vv):
            """Per step, the K, V held, the next hop in flight meanwhile."""
            for step in range(world):
                if step + 1 < world:
                    nk, nv = torch.empty_like(kk), torch.empty_like(vv)
                    reqs = p2p([kk, vv], [nk, nv])
                yield step, kk, vv
                if step + 1 < world:
                    for r in reqs:
                        r.wait()
                    kk, vv = nk, nv

        with kernel_calls_count_once(counts, [_YardstickKernel]), _OpCounter(counts):
            out = lse = None
            for step, kk, vv in ring(k, v):
                if step == 0:
                    out, lse = kernel.forward(q, kk, vv, True, scale)
                    out, lse = out.float(), lse.unsqueeze(-1)
                elif step <= rank:
                    o, l = kernel.forward(q, kk[:, :, :half], vv[:, :, :half], False, scale)
                    out, lse = _update(out, lse, o, l)
                else:
                    o, l = kernel.forward(q[:, :, half:], kk, vv, False, scale)
                    out[:, :, half:], lse[:, :, half:] = _update(out[:, :, half:], lse[:, :, half:], o, l)
            out, lse = out.to(q.dtype), lse.squeeze(-1).transpose(1, 2).contiguous()
            # backward
            dq = torch.zeros_like(q, dtype=torch.float32)
            dk_acc = dv_acc = None
            for step, kk, vv in ring(k, v):
                if step == 0:
                    gq, gk, gv = kernel.backward(dout, q, kk, vv, out, lse, True, scale)
                    dk_acc, dv_acc = gk.float(), gv.float()
                    dq += gq
                else:
                    if step <= rank:
                        gq, gk, gv = kernel.backward(dout, q, kk[:, :, :half], vv[:, :, :half], out, lse, False, scale)
                        dq += gq
                        dk_acc[:, :, :half] += gk
                        dv_acc[:, :, :half] += gv
                    else:
                        gq, gk, gv = kernel.backward(dout[:, :, half:], q[:, :, half:], kk, vv, out[:, :, half:],
                                                     lse[:, :, half:], False, scale)
                        dq[:, :, half:] += gq
                        dk_acc += gk
                        dv_acc += gv
                if step > 0:  # the accumulators travel with K, V
                    ndk, ndv = torch.empty_like(dk_acc), torch.empty_like(dv_acc)
                    for r in p2p([dk_acc, dv_acc], [ndk, ndv]):
                        r.wait()
                    dk_acc, dv_acc = ndk, ndv
            dq.to(q.dtype), dk_acc.to(k.dtype), dv_acc.to(v.dtype)
    return counts


def count(case: Case, sites: bool = False) -> Counts:
    """:func:`count_startrail`, or :func:`count_yardstick` for team size 0 (written here, not in
    the package: it has no issuing lines to charge, so ``sites`` is refused for it)."""
    if case.team == 0:
        if sites:
            raise ValueError(f"{case.name}: the yardstick ring runs no package code; sites are for StarTrail cases")
        return count_yardstick(case)
    return count_startrail(case, sites)


def production_cases(tokens: int = 131072) -> list[Case]:
    """The cases of the GPU hot-path issue: 8 heads x 128 per TP rank, bf16."""
    cases = []
    for world, team in ((8, 1), (8, 2), (16, 4)):
        tag = f"P{world} C{team}"
        cases += [
            Case(f"{tag} dense causal", world, team, tokens),
            Case(f"{tag} dense unmasked", world, team, tokens, causal=False),
            Case(f"{tag} GQA 8:1", world, team, tokens, kv_heads=1),
            Case(f"{tag} MLA 192/128", world, team, tokens, head_dim=192),
            Case(f"{tag} window (4096, 0)", world, team, tokens, window=(4096, 0)),
            Case(f"{tag} window (T/16, 0)", world, team, tokens, window=(tokens // 16, 0)),
            Case(f"{tag} packed, sample layout", world, team, tokens, docs="sample"),
            Case(f"{tag} packed, document layout", world, team, tokens, docs="document"),
            Case(f"{tag} rotation q", world, team, tokens, rotation="q"),
            Case(f"{tag} rotation kv", world, team, tokens, rotation="kv"),
            Case(f"{tag} regathering", world, team, tokens, regather=True),
        ]
    cases += [Case("P8 yardstick zigzag ring", 8, 0, tokens), Case("P16 yardstick zigzag ring", 16, 0, tokens)]
    # --qk-clip / --log-max-attention-logit: the same layers with the max-logit pass (max_logit.py)
    for world, team in ((8, 1), (8, 2), (16, 4)):
        tag = f"P{world} C{team}"
        cases += [
            Case(f"{tag} dense causal, max logit", world, team, tokens, max_logit=True),
            Case(f"{tag} dense unmasked, max logit", world, team, tokens, causal=False, max_logit=True),
            Case(f"{tag} GQA 8:1, max logit", world, team, tokens, kv_heads=1, max_logit=True),
            Case(f"{tag} window (4096, 0), max logit", world, team, tokens, window=(4096, 0), max_logit=True),
            Case(f"{tag} packed, document layout, max logit", world, team, tokens, docs="document",
                 max_logit=True),
        ]
    return cases


def _table(rows, before) -> list[str]:
    """Markdown: one row a case; with ``before`` (rows of an earlier run), its launches too."""
    prior = {r["case"]: r for r in before or []}
    dense = {(r["world"], r["team"]): r["launch"] for r in rows if r["case"].endswith("dense causal")}
    ring = {r["world"]: r["launch"] for r in rows if r["team"] == 0}
    head = ("| case | launch | kernel calls | comm | all ops | non-kernel GB | vs dense (same P, C) "
            "| vs yardstick (same P) |")
    if before:
        head += " launch before | kernel calls before |"
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        d = dense.get((r["world"], r["team"]))
        cells = [r["case"], r["launch"], r["kernel"], r["comm"], r["all"], f"{r['bytes'] / 1e9:.2f}",
                 f"{r['launch'] / d:.2f}x" if d and r["team"] else "-",
                 f"{r['launch'] / ring[r['world']]:.2f}x" if r["world"] in ring else "-"]
        if before:
            p = prior.get(r["case"], {})
            cells += [p.get("launch", "-"), p.get("kernel", "-")]
        out.append("| " + " | ".join(str(c) for c in cells) + " |")
    return out


def table_args(doc: str, sites: bool = False) -> argparse.Namespace:
    """The command line of this script and of layer_traffic.py (the same flags; ``sites``: with
    layer_traffic's ``--sites``)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--before", help="rows of an earlier run (its --json) to show beside these")
    parser.add_argument("--only", help="run the cases whose name contains this")
    if sites:
        parser.add_argument("--sites", type=int, default=0, metavar="N",
                            help="each case's N issuing lines that move the most bytes, after the table")
    return parser.parse_args()


def read_rows(path: str | None) -> list[dict] | None:
    """The rows an earlier run wrote with --json (None: no path)."""
    if not path:
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def write_rows(path: str | None, rows: list[dict]) -> None:
    """The rows as JSON at ``path`` (--json; nothing when None), what :func:`read_rows` reads back."""
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)


def main() -> None:
    args = table_args(__doc__)
    rows = []
    for case in production_cases(args.tokens):
        if args.only and args.only not in case.name:
            continue
        c = count(case)
        rows.append({"case": case.name, **dataclasses.asdict(case), "launch": c.launch, "kernel": c.kernel,
                     "comm": c.comm, "all": c.all, "bytes": c.bytes, "top_ops": dict(c.by_op.most_common(8))})
        print(f"{case.name}: launch {c.launch}, kernel {c.kernel}, comm {c.comm}, all {c.all}", flush=True)
    before = read_rows(args.before)
    print(f"\nOne rank, one layer's forward + backward, {args.tokens} tokens, bf16, 8 heads x 128 "
          "(meta tensors, torch's fake process group; the block kernel counts one op a call):\n")
    print("\n".join(_table(rows, before)))
    write_rows(args.json, rows)


if __name__ == "__main__":
    main()
