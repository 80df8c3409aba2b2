"""Stand-in flash-attn builds written from flash-attn's documented API, not from the adapter.

Each fake is one release's public surface as its docstrings and signatures give it
(checked against Dao-AILab/flash-attention's history): ``flash_attn_varlen_func`` on
``[total, h, d]`` with ``cu_seqlens`` (int32, ``[n + 1]``), GQA by head groups, a causal
mask aligned bottom-right, and ``window_size = (left, right)``: query ``i`` of a sequence
sees keys ``[i + sk - sq - left, i + sk - sq + right]`` (-1 unbounded; causal makes right 0),
the rule of :func:`tests.attention_cases.flash_rule`. What each release returns:

    flash-attn 2.5.x   (out, lse [n_seq, h, max_seqlen_q], S_dmask) with return_attn_probs
    flash-attn 2.6.x+  (out, lse [h, total_q], S_dmask)              with return_attn_probs
    FA3 before 07-11   (out, lse [h, total_q]) always (no return_attn_probs parameter)
    FA3 07-11..08-28   out only (no return_attn_probs parameter)
    FA3 from 08-29     (out, lse [h, total_q]) with return_attn_probs

The backward functions take the forward's out and lse and write dq, dk, dv in place, with
each release's parameter names. Arithmetic is float64 (so the adapters' plumbing compares
exactly), from the softmax's definition and flash-attn's backward recurrence; nothing of
the project's kernels.
"""

from __future__ import annotations

import sys
import types

import torch

from tests.attention_cases import flash_rule


def _sequences(cu_q, cu_k):
    cq, ck = cu_q.tolist(), cu_k.tolist()
    return list(zip(zip(cq, cq[1:]), zip(ck, ck[1:])))


def _checked(q, k, v, cu_q, cu_k, max_q, max_k):
    # What flash-attn's C++ checks (mha_varlen_fwd / bwd) before it runs.
    assert all(t.stride(-1) == 1 for t in (q, k, v)), "last dim must be contiguous"
    assert q.shape[-1] == k.shape[-1] == v.shape[-1] and q.shape[-1] % 8 == 0
    assert q.shape[1] % k.shape[1] == 0 and k.shape[1] == v.shape[1]
    assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.shape == cu_k.shape
    assert max_q >= int(cu_q.diff().max()) and max_k >= int(cu_k.diff().max())


def _scores(qi, ki, scale, causal, window):
    """Scores ``[h, sq, sk]`` float64 with flash-attn's mask, K heads repeated for GQA."""
    left, right = window
    if causal:
        right = 0
    ki = ki.double().repeat_interleave(qi.shape[1] // ki.shape[1], dim=1)
    s = torch.einsum("qhd,khd->hqk", qi.double(), ki) * scale
    return s.masked_fill(~flash_rule(qi.shape[0], ki.shape[0], (left, right)), float("-inf"))


def dense_forward(q, k, v, cu_q, cu_k, scale, causal, window):
    """out ``[total_q, h, d]`` (q's dtype) and lse ``[h, total_q]`` float32 (float64 for float64)."""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float64)
    for (q0, q1), (k0, k1) in _sequences(cu_q, cu_k):
        s = _scores(q[q0:q1], k[k0:k1], scale, causal, window)
        lse[:, q0:q1] = torch.logsumexp(s, dim=-1)
        vi = v[k0:k1].double().repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), vi).to(q.dtype)
    return out, lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)


def dense_backward(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, scale, causal, window):
    """flash-attn's backward from the given out and lse ``[h, total_q]``: P = exp(S - lse),
    dS = P * (dP - rowsum(dO * O)); K/V gradients summed over each GQA head group."""
    assert lse.shape == (q.shape[1], q.shape[0]), "varlen lse is [h, total_q]"
    group = q.shape[1] // k.shape[1]
    for (q0, q1), (k0, k1) in _sequences(cu_q, cu_k):
        p = torch.exp(_scores(q[q0:q1], k[k0:k1], scale, causal, window) - lse[:, q0:q1, None].double())
        do, o = dout[q0:q1].double(), out[q0:q1].double()
        vi = v[k0:k1].double().repeat_interleave(group, dim=1)
        ki = k[k0:k1].double().repeat_interleave(group, dim=1)
        ds = p * (torch.einsum("qhd,khd->hqk", do, vi) - (do * o).sum(-1).T[..., None])
        dq[q0:q1] = (torch.einsum("hqk,khd->qhd", ds, ki) * scale).to(dq.dtype)
        gk = torch.einsum("hqk,qhd->khd", ds, q[q0:q1].double()) * scale
        gv = torch.einsum("hqk,qhd->khd", p, do)
        dk[k0:k1] = gk.unflatten(1, (k.shape[1], group)).sum(2).to(dk.dtype)
        dv[k0:k1] = gv.unflatten(1, (v.shape[1], group)).sum(2).to(dv.dtype)


def _padded_lse(lse, cu_q, max_q):
    # flash-attn < 2.6: the varlen lse padded per sequence, [n_seq, h, max_seqlen_q].
    padded = torch.full((len(cu_q) - 1, lse.shape[0], max_q), float("inf"), dtype=lse.dtype)
    for i, ((q0, q1), _) in enumerate(_sequences(cu_q, cu_q)):
        padded[i, :, : q1 - q0] = lse[:, q0:q1]
    return padded


def _scale(softmax_scale, q):
    return softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5


# --- flash-attn 2.x (flash_attn.flash_attn_interface) ---------------------------------------

def _fa2_forward(padded_lse: bool):
    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                               alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
        assert dropout_p == 0.0 and softcap == 0.0 and alibi_slopes is None and block_table is None
        _checked(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        out, lse = dense_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, _scale(softmax_scale, q), causal, window_size)
        if padded_lse:
            lse = _padded_lse(lse, cu_seqlens_q, max_seqlen_q)
        return (out, lse, None) if return_attn_probs else out  # S_dmask: None without dropout

    return flash_attn_varlen_func


def _fa2_backward_window_tuple(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                               max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
                               alibi_slopes, deterministic, rng_state=None):
    # flash-attn 2.6.x
    assert dropout_p == 0.0 and softcap == 0.0 and alibi_slopes is None
    _checked(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    dense_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal,
                   window_size)


def _fa2_backward_window_ints(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                              max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left,
                              window_size_right, softcap, alibi_slopes, deterministic, rng_state=None,
                              zero_tensors=False):
    # flash-attn 2.7 / 2.8
    assert dropout_p == 0.0 and softcap == 0.0 and alibi_slopes is None and not zero_tensors
    _checked(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    dense_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal,
                   (window_size_left, window_size_right))


def flash_attn_2(version: str):
    """``(flash_attn, flash_attn.flash_attn_interface)`` of flash-attn ``version`` (2.5.x: lse padded
    per sequence; 2.6.x: backward takes ``window_size``; 2.7+: ``window_size_left`` / ``right``)."""
    minor = int(version.split(".")[1])
    package = types.ModuleType("flash_attn")
    package.__version__ = version
    interface = types.ModuleType("flash_attn.flash_attn_interface")
    interface.flash_attn_varlen_func = _fa2_forward(padded_lse=minor < 6)
    interface._flash_attn_varlen_backward = _fa2_backward_window_tuple if minor < 7 else _fa2_backward_window_ints
    package.flash_attn_interface = interface
    return package, interface


# --- flash-attn 3 (the hopper/ build's top-level flash_attn_interface) ------------------------

def _fa3_run(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, window_size, neutral):
    assert all(x in (None, 0, 0.0, 1) for x in neutral), "an option this fake does not model"
    _checked(q, k, v, cu_q, cu_k, max_q, max_k)
    return dense_forward(q, k, v, cu_q, cu_k, _scale(softmax_scale, q), causal, window_size)


def _fa3_forward(build: str):
    if build >= "2025-08-29":  # PR #1851: lse on request
        def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                                   seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None,
                                   k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0,
                                   softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0,
                                   return_attn_probs=False):
            out, lse = _fa3_run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                                window_size, (seqused_q, seqused_k, qv, q_descale, k_descale, v_descale,
                                              attention_chunk, softcap, num_splits, pack_gqa, sm_margin))
            return (out, lse) if return_attn_probs else out
        return flash_attn_varlen_func

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                               seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None,
                               k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
                               num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0):
        out, lse = _fa3_run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                            window_size, (seqused_q, seqused_k, qv, q_descale, k_descale, v_descale, attention_chunk,
                                          softcap, num_splits, pack_gqa, sm_margin))
        return out if build >= "2025-07-11" else (out, lse)  # "[FA3] Don't return lse" (2025-07-11)
    return flash_attn_varlen_func


def _fa3_backward_before_0716(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, sequed_q, sequed_k,
                              max_seqlen_q, max_seqlen_k, dq, dk, dv, softmax_scale, causal, window_size=(-1, -1),
                              softcap=0.0, deterministic=False, sm_margin=0):
    assert sequed_q is None and sequed_k is None and softcap == 0.0 and sm_margin == 0
    _checked(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    dense_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal,
                   window_size)


def _fa3_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q=None, cu_seqlens_k=None, sequed_q=None,
                  sequed_k=None, max_seqlen_q=None, max_seqlen_k=None, dq=None, dk=None, dv=None, softmax_scale=None,
                  is_causal=False, window_size_left=-1, window_size_right=-1, softcap=0.0, deterministic=False,
                  sm_margin=0):
    # From 2025-07-16 (torch.compile support): every argument optional, the window as two ints.
    assert sequed_q is None and sequed_k is None and softcap == 0.0 and sm_margin == 0
    _checked(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    dense_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, softmax_scale, is_causal,
                   (window_size_left, window_size_right))


def flash_attn_3(build: str, version: str = "3.0.0b1"):
    """``(flash_attn_3, flash_attn_interface)`` of the FA3 build of date ``build`` ("YYYY-MM-DD");
    every build of 2024-07 .. 2026-02 says version 3.0.0b1."""
    package = types.ModuleType("flash_attn_3")
    package.__version__ = version
    interface = types.ModuleType("flash_attn_interface")
    interface.flash_attn_varlen_func = _fa3_forward(build)
    interface._flash_attn_backward = _fa3_backward_before_0716 if build < "2025-07-16" else _fa3_backward
    return package, interface


def install(monkeypatch, fa2: str | None = None, fa3: str | None = None) -> dict:
    """Put fake flash-attn ``fa2`` (a version) and FA3 ``fa3`` (a build date) in ``sys.modules``
    (None: not installed, its import fails); returns the interface modules by backend."""
    installed = {}
    pairs = {"flash_attn": (fa2, flash_attn_2, ("flash_attn", "flash_attn.flash_attn_interface")),
             "flash_attn_3": (fa3, flash_attn_3, ("flash_attn_3", "flash_attn_interface"))}
    for backend, (which, make, names) in pairs.items():
        modules = make(which) if which else (None, None)
        for name, module in zip(names, modules):
            monkeypatch.setitem(sys.modules, name, module)
        if which:
            installed[backend] = modules[1]
    return installed
