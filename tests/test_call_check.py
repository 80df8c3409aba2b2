"""Every kernel launch goes through the host call check (issue 54, finding 4; issue 49's check).

kernels/call_check.py compares a call's metadata with its tensors before a kernel launches.
On 3a17b64 it wrapped ``forward`` and ``backward`` only, and ``blocks.backward_step`` hands
the per-sequence kernels' calls (reference, CPU flash, efficient, cuDNN) to ``backward_into``:
one dense forward + backward checked its forward calls and none of its backward ones, and a
call planned for 8 rows handed 6-row tensors ran and returned wrong gradients.

1. One rank of a StarTrail layer (torch's no-op process group, benchmarks/launch_budget's
   ``fake_rank``) with the kernel the layer chose wrapped: every call the schedule makes
   into the kernel, whatever its name, is counted with the checks it ran and the launches it
   made (the op the kernel proper calls), across CP layouts, both rotations and every
   adapter. A launch outside a checked call fails, and so does a call checked twice.
2. One case per way a call and its tensors can disagree, refused by every adapter through
   every entry that takes that tensor, before anything is written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import types
from collections import Counter

import pytest
import torch

from benchmarks.counters.launch_budget import fake_rank
from megatron_startrail import attention, kernels, new_startrail_groups, startrail_attn
from megatron_startrail.kernels import call_check, torch_cuda
from megatron_startrail.kernels.call_check import CheckedKernel
from megatron_startrail.kernels.varlen import PerSequenceKernel
from megatron_startrail.layout import KernelCall
from tests import flash_attn_fakes

ENTRIES = ("forward", "backward", "backward_into")  # the kernel interface (kernels/base.py, varlen.py)
FAKE_FLASH = dict(fa2="2.8.3", fa3="2025-08-29")


# --- 1. every call the schedule makes into the kernel is checked, once --------------------------


class _Ledger:
    """What one layer did to its kernel: per entry, calls, checks and launches; launches that
    ran outside a checked call."""

    def __init__(self) -> None:
        self.counts = Counter()
        self.entry, self.checks_in_entry, self.unchecked = None, 0, 0

    def table(self) -> dict:
        return {e: tuple(self.counts[e, what] for what in ("calls", "checked", "launches"))
                for e in sorted({e for e, _ in self.counts if e is not None})}


class _Watched:
    """The layer's kernel as the schedule sees it: every method it calls is counted (a name
    the kernel lacks stays missing, so ``getattr(kernel, "backward_into", None)`` is unchanged)."""

    def __init__(self, inner, ledger: _Ledger) -> None:
        self._inner, self._ledger = inner, ledger

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr
        ledger = self._ledger

        def entry(*args, **kwargs):
            assert ledger.entry is None, f"{name} called inside {ledger.entry}"
            ledger.entry, ledger.checks_in_entry = name, 0
            ledger.counts[name, "calls"] += 1
            try:
                return attr(*args, **kwargs)
            finally:
                ledger.entry = None
        return entry


def _launch_points(kernel):
    """(object, attribute) of the functions that launch the kernel proper's work."""
    if isinstance(kernel, PerSequenceKernel):  # reference, CPU flash, efficient, cuDNN: one per launch
        return [(kernel, "_attend"), (kernel, "_attend_backward")]
    if kernel.name == "torch_cuda_flash":
        return [(torch_cuda._aten, "_flash_attention_forward"), (torch_cuda._aten, "_flash_attention_backward")]
    return [(kernel._interface, "flash_attn_varlen_func"), (kernel._interface, kernel._backward_fn)]


@contextlib.contextmanager
def watched_kernel(monkeypatch, kernel_name: str):
    """Inside: every layer's kernel (``kernel_name``: chosen by the layer for "auto" and
    "reference", else that adapter made directly) is watched; yields the ledger."""
    ledger = _Ledger()
    check = call_check.check_call

    def counted_check(*args, **kwargs):
        ledger.counts[ledger.entry, "checked"] += 1
        ledger.checks_in_entry += 1
        return check(*args, **kwargs)

    def launch(fn):
        @functools.wraps(fn)
        def launched(*args, **kwargs):
            if ledger.entry is None or ledger.checks_in_entry == 0:
                ledger.unchecked += 1
            else:
                ledger.counts[ledger.entry, "launches"] += 1
            return fn(*args, **kwargs)
        return launched

    def watch(kernel):
        if kernel_name == "torch_cuda_flash":  # the module's ops: one shared namespace, wrapped per test
            monkeypatch.setattr(torch_cuda, "_aten", types.SimpleNamespace(
                _flash_attention_forward=torch.ops.aten._flash_attention_forward,
                _flash_attention_backward=torch.ops.aten._flash_attention_backward))
        elif kernel_name.startswith("flash_attn"):
            kernel._interface = types.SimpleNamespace(**vars(kernel._interface))
        for owner, attr in _launch_points(kernel):
            setattr(owner, attr, launch(getattr(owner, attr)))
        return _Watched(kernel, ledger)

    monkeypatch.setattr(call_check, "check_call", counted_check)
    _inject_kernel(monkeypatch, kernel_name, watch)
    yield ledger


def _inject_kernel(monkeypatch, kernel_name, watch):
    """The layer's kernel (chosen once at the entry, kernels.choose_layer_kernel) watched."""
    chosen = attention.choose_layer_kernel

    def choose(*args, **kwargs):
        layer = chosen(*args, **kwargs)
        made = layer.kernel if kernel_name in ("auto", "reference") else kernels.make_kernel(kernel_name)
        return dataclasses.replace(layer, kernel=watch(made))
    monkeypatch.setattr(attention, "choose_layer_kernel", choose)


# (P, C, rotation, regather, head dims (q/k, v)): both rotations at every layout, MLA dims on
# rotation "q" (the padded path of the kernels that want one head dim).
LAYOUTS = [(2, 1, "kv", False, (16, 16)), (2, 1, "q", False, (16, 8)), (4, 1, "kv", False, (16, 16)),
           (4, 1, "q", True, (16, 8)), (4, 2, "kv", True, (16, 16)), (4, 2, "q", False, (16, 8))]
# the device each kernel runs on here: CUDA adapters on meta tensors (their ops' meta kernels),
# the fake flash-attn builds (tests/flash_attn_fakes.py) on the CPU
KERNELS = {"reference": ("cpu", torch.float32), "auto": ("cpu", torch.float32),
           "torch_cuda_flash": ("meta", torch.bfloat16), "torch_cuda_efficient": ("meta", torch.bfloat16),
           "torch_cuda_cudnn": ("meta", torch.bfloat16), "flash_attn": ("cpu", torch.bfloat16),
           "flash_attn_3": ("cpu", torch.bfloat16)}


def _one_layer(P, C, rotation, regather, dims, device, dtype, kernel, **layer):
    with fake_rank(1, P):
        groups = new_startrail_groups(team_size=C, backward_rotation=rotation, regather_in_backward=regather,
                                      kernel="reference" if kernel == "reference" else "auto")
        n = 8 * P  # rows per rank
        q, k = (torch.randn(n, 1, h, dims[0], dtype=dtype).to(device).requires_grad_() for h in (4, 2))
        v = torch.randn(n, 1, 2, dims[1], dtype=dtype).to(device).requires_grad_()
        out = startrail_attn(q, k, v, groups, **layer)
        torch.autograd.grad(out, (q, k, v), torch.randn(out.shape, dtype=dtype).to(device))


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_every_launch_of_a_layer_is_checked(monkeypatch, kernel):
    if kernel.startswith("flash_attn"):
        flash_attn_fakes.install(monkeypatch, **FAKE_FLASH)
    device, dtype = KERNELS[kernel]
    cases = [(layout, {}) for layout in LAYOUTS]
    if kernel in ("reference", "auto"):  # the halo exchange's kernel calls, and packed documents
        cases += [((4, 1, "kv", False, (16, 16)), dict(window_size=(5, 0))),
                  ((4, 2, "q", False, (16, 16)), dict(cu_seqlens=torch.tensor([0, 20, 64, 128], dtype=torch.int32)))]
    tables = []
    for (P, C, rotation, regather, dims), layer in cases:
        with watched_kernel(monkeypatch, kernel) as ledger:
            _one_layer(P, C, rotation, regather, dims, device, dtype, kernel, **layer)
        table = ledger.table()
        tables.append(((P, C, rotation, regather, dims, tuple(layer)), table, ledger.unchecked))
        monkeypatch.undo()
        if kernel.startswith("flash_attn"):
            flash_attn_fakes.install(monkeypatch, **FAKE_FLASH)
    print(f"\n{kernel}: per entry (calls, checked, launches)")
    for case, table, unchecked in tables:
        print(f"  P, C, rotation, regather, dims, extra = {case}: {table}, unchecked launches {unchecked}")
    for case, table, unchecked in tables:
        assert unchecked == 0, (case, table, unchecked)
        assert set(table) <= set(ENTRIES), (case, table)  # the schedule calls nothing else of a kernel
        for entry, (calls, checked, launches) in table.items():
            assert calls == checked, (case, entry, table)  # every call checked, once
            assert launches >= calls, (case, entry, table)
        assert table.get("forward", (0,))[0] > 0, (case, table)
        assert sum(table.get(e, (0,))[0] for e in ("backward", "backward_into")) > 0, (case, table)


def test_every_adapter_enters_through_the_check(monkeypatch):
    """The check is first in every adapter's bases, and every entry of the kernel interface
    resolves to it (no adapter launches through a method of its own that skips it)."""
    assert getattr(call_check, "ENTRIES", None) == ENTRIES
    for kernel, _, _ in _adapters(monkeypatch):
        cls = type(kernel)
        assert cls.__mro__[1] is CheckedKernel, cls.__mro__
        for entry in ENTRIES:
            assert getattr(cls, entry) is getattr(CheckedKernel, entry), (cls, entry)


# --- 2. every way a call and its tensors can disagree is refused, in every entry ----------------

TQ, TK, B, H, HKV, DQK, DV = 12, 20, 2, 4, 2, 16, 8
CALL = KernelCall.back_to_back([(5, 9), (7, 11)], (-1, 0))  # two sequences: 12 query rows, 20 key rows


def _adapters(monkeypatch):
    """(kernel, device, dtype) for every adapter: the CUDA ones on meta tensors, the fake
    flash-attn builds and the CPU kernels on the CPU."""
    flash_attn_fakes.install(monkeypatch, **FAKE_FLASH)
    return [(kernels.make_kernel("reference"), "cpu", torch.float32),
            (kernels.make_kernel("torch_cpu_flash"), "cpu", torch.float32),
            *((kernels.make_kernel(n), "meta", torch.bfloat16)
              for n in ("torch_cuda_flash", "torch_cuda_efficient", "torch_cuda_cudnn")),
            *((kernels.make_kernel(n), "cpu", torch.bfloat16) for n in ("flash_attn", "flash_attn_3"))]


def _tensors(device, dtype) -> dict:
    """What an entry takes for CALL, all agreeing with it; grads poisoned (never written on a refusal)."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen, dtype=acc).to(device=device, dtype=dt)
    t = dict(q=rand(TQ, B, H, DQK), k=rand(TK, B, HKV, DQK), v=rand(TK, B, HKV, DV), out=rand(TQ, B, H, DV),
             dout=rand(B, TQ, H, DV).transpose(0, 1), lse=rand(B, H, TQ, dt=acc))
    t.update(dq=torch.full((TQ, B, H, DQK), 7.0, dtype=acc, device=device),
             dk=torch.full((TK, B, HKV, DQK), 7.0, dtype=acc, device=device),
             dv=torch.full((TK, B, HKV, DV), 7.0, dtype=acc, device=device))
    return t


def _enter(kernel, entry, t, call):
    if entry == "forward":
        return kernel.forward(t["q"], t["k"], t["v"], call, scale=0.3)
    args = (t["dout"], t["q"], t["k"], t["v"], t["out"], t["lse"], call)
    if entry == "backward":
        return kernel.backward(*args, scale=0.3)
    return kernel.backward_into((t["dq"], t["dk"], t["dv"]), *args, scale=0.3)


def _rows(n):
    return lambda x: torch.cat([x, x[:1]]) if n > 0 else x[:-1]


def _dim(dim, size):
    """``x`` with dim ``dim`` made ``size`` long (cut, or grown by repeating its first entry)."""
    def change(x):
        have = x.shape[dim]
        return x.narrow(dim, 0, size) if size <= have else torch.cat([x, x.narrow(dim, 0, 1).expand(
            *(size - have if i == dim % x.dim() else s for i, s in enumerate(x.shape)))], dim)
    return change


def _strided_last(x):
    return torch.cat([x, x], -1)[..., ::2]


def _seq_first_lse(x):
    return x.permute(2, 0, 1)  # [Tq, b, h]: the schedule's layout, not the kernel's


FORWARD, BACKWARD = ENTRIES, ("backward", "backward_into")
# (id, tensor, change, entries that take the tensor, what the refusal says)
MISMATCHES = [
    *((f"{name} rows {how}", name, _rows(n), FORWARD if name in "qkv" else BACKWARD,
       f"call has {TQ if name in ('q', 'out', 'dout') else TK} {'query' if name in ('q', 'out', 'dout') else 'key'} "
       f"rows but {name} holds {(TQ if name in ('q', 'out', 'dout') else TK) + n} rows")
      for name in ("q", "k", "v", "out", "dout") for how, n in (("short", -1), ("over", 1))),
    *((f"lse rows {how}", "lse", _dim(2, TQ + n), BACKWARD, rf"lse is \[{B}, {H}, {TQ + n}\], not \[{B}, {H}, {TQ}\]")
      for how, n in (("short", -1), ("over", 1))),
    *((f"{name} rows {how}", name, _rows(n), ("backward_into",), f"{name} .* must be {src}'s shape")
      for name, src in (("dq", "q"), ("dk", "k"), ("dv", "v")) for how, n in (("short", -1), ("over", 1))),
    ("k batch", "k", _dim(1, 1), FORWARD, "must have one batch size"),
    ("v batch", "v", _dim(1, 3), FORWARD, "must have one batch size"),
    ("out batch", "out", _dim(1, 1), BACKWARD, rf"out \[{TQ}, 1, {H}, {DV}\] .* must be \[{TQ}, {B}, {H}, {DV}\]"),
    ("dout batch", "dout", _dim(1, 3), BACKWARD, rf"dout \[{TQ}, 3, {H}, {DV}\] .* must be"),
    ("lse batch", "lse", _dim(0, 1), BACKWARD, rf"lse is \[1, {H}, {TQ}\]"),
    ("dk batch", "dk", _dim(1, 1), ("backward_into",), "dk .* must be k's shape"),
    ("k heads", "k", _dim(2, 3), FORWARD, f"need one head count that divides q's {H}"),
    ("v heads", "v", _dim(2, 1), FORWARD, f"need one head count that divides q's {H}"),
    ("out heads", "out", _dim(2, 2), BACKWARD, r"out .* must be \["),
    ("dout heads", "dout", _dim(2, 8), BACKWARD, r"dout .* must be \["),
    ("lse heads", "lse", _dim(1, 2), BACKWARD, rf"lse is \[{B}, 2, {TQ}\]"),
    ("dq heads", "dq", _dim(2, 2), ("backward_into",), "dq .* must be q's shape"),
    ("k head dim", "k", _dim(3, DQK - 8), FORWARD, "need one head dim"),
    ("out head dim", "out", _dim(3, DV + 8), BACKWARD, r"out .* must be .* \(q's rows, v's head dim\)"),
    ("dout head dim", "dout", _dim(3, DQK), BACKWARD, r"dout .* must be .* \(q's rows, v's head dim\)"),
    ("dv head dim", "dv", _dim(3, DQK), ("backward_into",), "dv .* must be v's shape"),
    ("k dtype", "k", lambda x: x.to(torch.float16), FORWARD, "q, k and v need one dtype"),
    ("v dtype", "v", lambda x: x.double(), FORWARD, "q, k and v need one dtype"),
    ("out dtype", "out", lambda x: x.double(), BACKWARD, r"out .* torch.float64 must be"),
    ("dout dtype", "dout", lambda x: x.to(torch.float16), BACKWARD, r"dout .* torch.float16 must be"),
    ("lse dtype", "lse", lambda x: x.to(torch.bfloat16), BACKWARD, "lse is torch.bfloat16"),
    ("q layout: no batch dim", "q", lambda x: x[:, 0], FORWARD, r"q must be \[rows, batch, heads, head dim\]"),
    ("q layout: strided head dim", "q", _strided_last, FORWARD, "q .* has a strided last dim"),
    ("k layout: strided head dim", "k", _strided_last, FORWARD, "k .* has a strided last dim"),
    ("v layout: strided head dim", "v", _strided_last, FORWARD, "v .* has a strided last dim"),
    ("q layout: batch first", "q", lambda x: x.transpose(0, 1), FORWARD, f"call has {TQ} query rows but q holds {B}"),
    ("lse layout: sequence first", "lse", _seq_first_lse, BACKWARD, rf"lse is \[{TQ}, {B}, {H}\]"),
    ("dq layout: batch first", "dq", lambda x: x.transpose(0, 1), ("backward_into",), "dq .* must be q's shape"),
]
# the call itself: its cu_seqlens, and its longest sequence
BAD_CALLS = [
    ("cu_seqlens falling", KernelCall(((0, 7), (7, 5)), (((0, 11),), ((11, 20),)), (-1, 0)), "does not rise from 0"),
    ("max_seqlen", type("LyingCall", (KernelCall,), {"max_seqlen_q": 5})(CALL.q_rows, CALL.k_rows, CALL.window),
     "max_seqlen of cu_seqlens_q is 5, its longest sequence 7"),
]


def test_tensors_that_agree_with_their_call_are_accepted(monkeypatch):
    """The cases below differ from these in one thing each: what refuses them is that thing."""
    for kernel, device, dtype in _adapters(monkeypatch):
        for entry in ENTRIES:
            _enter(kernel, entry, _tensors(device, dtype), CALL)


def _refused(monkeypatch, entries, change_tensors, call, match):
    tried = Counter()
    for kernel, device, dtype in _adapters(monkeypatch):
        for entry in entries:
            t = change_tensors(_tensors(device, dtype))
            with pytest.raises(ValueError, match=f"{kernel.name}: .*{match}"):
                _enter(kernel, entry, t, call)
            if device == "cpu":
                for g in ("dq", "dk", "dv"):
                    assert t[g].eq(7.0).all(), (kernel.name, entry, g)  # nothing written before the refusal
            tried[entry] += 1
    assert set(tried) == set(entries) and min(tried.values()) == 7, tried


@pytest.mark.parametrize("case", MISMATCHES, ids=[m[0] for m in MISMATCHES])
def test_a_tensor_that_disagrees_with_its_call_is_refused(monkeypatch, case):
    _, name, change, entries, match = case
    _refused(monkeypatch, entries, lambda t: {**t, name: change(t[name])}, CALL, match)


@pytest.mark.parametrize("case", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_a_call_that_disagrees_with_itself_is_refused(monkeypatch, case):
    _, call, match = case
    _refused(monkeypatch, ENTRIES, lambda t: t, call, match)
