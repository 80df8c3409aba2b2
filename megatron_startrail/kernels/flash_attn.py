"""Adapters for Dao-AILab flash-attn: 2.x (``flash_attn``) and 3.x (``flash_attn_interface``,
the Hopper build). Optional: constructing one raises ImportError when it is not installed.

A call (Note [kernel calls] in :mod:`megatron_startrail.layout`) is ONE
``flash_attn_varlen_func``: the call's sequences with their ``cu_seqlens`` (views of the
micro-batch's one metadata buffer, Note [device metadata] in
:mod:`megatron_startrail.microbatch`) and its window, whose rule is the one the planner writes calls for. Both
take ``[total, h, d]`` (the batch folded into the rows), GQA natively, return lse
``[h, total]`` float32 (flash-attn >= 2.6; :mod:`.builds` checks each build once), and need
one head dim for q, k and v (a multiple of 8): MLA shapes are padded inside the call. Their private backward functions changed parameters
across releases (window, softcap, varlen, sm_margin arguments), so they are called by
parameter name -- the names looked up once per function -- with the neutral value for
each parameter this project does not use.
"""

from __future__ import annotations

import functools
import inspect

import torch

from .call_check import CheckedKernel
from .padding import EqualHeadDimsKernel
from .varlen import fold_batch, fold_lse, unfold_batch, unfold_lse

# Neutral values for the parameters of flash-attn's forward/backward that we do not use.
_NEUTRAL = {
    "dropout_p": 0.0, "softcap": 0.0, "alibi_slopes": None, "deterministic": False, "rng_state": None,
    "sm_margin": 0, "seqused_q": None, "seqused_k": None, "sequed_q": None, "sequed_k": None,
    "zero_tensors": False, "block_table": None,
}


@functools.lru_cache(maxsize=None)
def _parameters(fn) -> tuple[tuple[str, bool], ...]:
    """``(name, required)`` of ``fn``'s parameters (once per function: no signature lookup per call).
    flash-attn >= 2.7 registers its backward with torch.library.custom_op, whose object only
    shows (*args, **kwargs); the function it wraps has the real parameters."""
    params = inspect.signature(getattr(fn, "_init_fn", fn)).parameters.values()
    return tuple((p.name, p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
                 for p in params)


def call_by_name(fn, **values):
    """Call ``fn`` passing each of its parameters by name from ``values`` or ``_NEUTRAL``;
    a parameter with a default that neither names is left to its default."""
    kwargs = {}
    for name, required in _parameters(fn):
        if name in values:
            kwargs[name] = values[name]
        elif name in _NEUTRAL:
            kwargs[name] = _NEUTRAL[name]
        elif required:
            raise TypeError(f"{getattr(fn, '__name__', fn)} has a parameter {name!r} this adapter does not know")
    return fn(**kwargs)


class _FlashAttnVarlen:
    """One ``flash_attn_varlen_func`` per call; ``_backward_fn`` names the matching backward."""

    _interface = None  # the flash-attn module
    _backward_fn = ""
    deterministic = False  # --deterministic-mode: flash-attn's deterministic backward

    def _deterministic(self) -> bool:
        return self.deterministic or torch.are_deterministic_algorithms_enabled()

    def _window_args(self, call, batch, device):
        return dict(
            cu_seqlens_q=call.tensor("cu_seqlens_q", device, batch), cu_seqlens_k=call.tensor("cu_seqlens_k", device, batch),
            max_seqlen_q=call.max_seqlen_q, max_seqlen_k=call.max_seqlen_k, causal=call.causal, is_causal=call.causal,
            window_size=(-1, -1) if call.causal else call.window,
            window_size_left=-1 if call.causal else call.window[0],
            window_size_right=-1 if call.causal else call.window[1],
        )

    def forward(self, q, k, v, call, *, scale):
        b = q.shape[1]
        args = self._window_args(call, b, q.device)
        res = call_by_name(self._interface.flash_attn_varlen_func, q=fold_batch(q), k=fold_batch(k),
                           v=fold_batch(v), softmax_scale=scale, return_attn_probs=True,
                           deterministic=self._deterministic(), **args)
        if isinstance(res, torch.Tensor):  # a defence: builds.py keeps such builds out of the usable set
            raise RuntimeError(f"{self._interface.__name__}.flash_attn_varlen_func returned no log-sum-exp "
                               "(flash-attn 3 builds of 2025-07-11 .. 2025-08-28 do; use one from 2025-08-29 on)")
        out, lse = res[0], res[1]  # 2.x: (out, lse, S_dmask); 3.x: (out, lse)
        if lse.dim() != 2:
            raise RuntimeError(f"{self._interface.__name__}: variable-length lse of shape {tuple(lse.shape)}; "
                               "flash-attn >= 2.6 returns [heads, total_q]")
        return unfold_batch(out, b), unfold_lse(lse, b)

    def backward(self, dout, q, k, v, out, lse, call, *, scale):
        b = q.shape[1]
        qf, kf, vf = (fold_batch(x).contiguous() for x in (q, k, v))
        dq, dk, dv = torch.empty_like(qf), torch.empty_like(kf), torch.empty_like(vf)
        call_by_name(
            getattr(self._interface, self._backward_fn), dout=fold_batch(dout).contiguous(), q=qf, k=kf, v=vf,
            out=fold_batch(out).contiguous(), softmax_lse=fold_lse(lse), dq=dq, dk=dk, dv=dv, softmax_scale=scale,
            deterministic=self._deterministic(), **self._window_args(call, b, q.device),
        )
        return unfold_batch(dq, b), unfold_batch(dk, b), unfold_batch(dv, b)


class FlashAttnKernel(CheckedKernel, EqualHeadDimsKernel, _FlashAttnVarlen):
    """flash-attn 2.x (``flash_attn.flash_attn_interface``)."""

    name = "flash_attn"
    workspace_grows_with_keys = False  # fused: out and lse of the query rows (Note [whole key runs])
    head_dim_multiple = 8
    _backward_fn = "_flash_attn_varlen_backward"

    def __init__(self) -> None:
        from flash_attn import flash_attn_interface  # noqa: PLC0415 - optional

        self._interface = flash_attn_interface


class FlashAttn3Kernel(CheckedKernel, EqualHeadDimsKernel, _FlashAttnVarlen):
    """flash-attn 3.x (the top-level ``flash_attn_interface`` module of the hopper/ build)."""

    name = "flash_attn_3"
    workspace_grows_with_keys = False  # fused: out and lse of the query rows (Note [whole key runs])
    head_dim_multiple = 8
    _backward_fn = "_flash_attn_backward"  # 3.x: one backward, variable length through cu_seqlens

    def __init__(self) -> None:
        import flash_attn_interface  # noqa: PLC0415 - optional

        self._interface = flash_attn_interface
