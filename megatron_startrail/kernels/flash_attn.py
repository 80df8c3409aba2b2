"""Adapters for Dao-AILab flash-attn: 2.x (``flash_attn``) and 3.x (``flash_attn_interface``,
the Hopper build). Optional: constructing one raises ImportError when it is not installed.

Both want ``[b, s, h, d]`` (a transpose of our ``[b, h, s, d]`` views, last dim
contiguous), take GQA natively, return lse ``[b, h, sq]`` float32, and need one head dim
for q, k and v (a multiple of 8): MLA shapes are padded inside the call. Their private
backward functions changed parameters across releases (window, softcap, varlen, sm_margin
arguments), so they are called by parameter name, with the neutral value for each
parameter this project does not use.
"""

from __future__ import annotations

import inspect

import torch

from .padding import EqualHeadDimsKernel, trim_lse

# Neutral values for the parameters of flash-attn's forward/backward that we do not use.
_NEUTRAL = {
    "dropout_p": 0.0, "window_size": (-1, -1), "window_size_left": -1, "window_size_right": -1,
    "softcap": 0.0, "alibi_slopes": None, "deterministic": False, "rng_state": None, "sm_margin": 0,
    "cu_seqlens_q": None, "cu_seqlens_k": None, "seqused_q": None, "seqused_k": None,
    "sequed_q": None, "sequed_k": None, "max_seqlen_q": None, "max_seqlen_k": None,
}


def call_by_name(fn, **values):
    """Call ``fn`` passing each of its parameters by name from ``values`` or ``_NEUTRAL``;
    a parameter with a default that neither names is left to its default."""
    kwargs = {}
    # flash-attn >= 2.7 registers its backward with torch.library.custom_op, whose object
    # only shows (*args, **kwargs); the function it wraps has the real parameters.
    for name, param in inspect.signature(getattr(fn, "_init_fn", fn)).parameters.items():
        if name in values:
            kwargs[name] = values[name]
        elif name in _NEUTRAL:
            kwargs[name] = _NEUTRAL[name]
        elif param.default is inspect.Parameter.empty and param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"{fn.__module__}.{fn.__name__} has a parameter {name!r} this adapter does not know")
    return fn(**kwargs)


def _bshd(x: torch.Tensor) -> torch.Tensor:
    # [b, h, s, d] <-> [b, s, h, d] (a view)
    return x.transpose(1, 2)


class _FlashAttnBase(EqualHeadDimsKernel):
    head_dim_multiple = 8
    _interface = None  # the flash-attn module with flash_attn_func / _flash_attn_backward

    def _forward(self, q, k, v, *, causal, scale):
        fn = self._interface.flash_attn_func
        extra = {"return_attn_probs": True} if "return_attn_probs" in inspect.signature(fn).parameters else {}
        res = fn(_bshd(q), _bshd(k), _bshd(v), softmax_scale=scale, causal=causal, **extra)
        if isinstance(res, torch.Tensor):  # a release that returns out only: no lse to merge with
            raise RuntimeError(f"{self._interface.__name__}.flash_attn_func returned no log-sum-exp")
        out, lse = res[0], res[1]  # 2.x: (out, lse, S_dmask); 3.x: (out, lse)
        return _bshd(out), trim_lse(lse, q.shape[2])

    def _backward(self, dout, q, k, v, out, lse, *, causal, scale):
        t = lambda x: _bshd(x).contiguous()  # noqa: E731 - [b, s, h, d], contiguous
        qt, kt, vt = t(q), t(k), t(v)
        dq, dk, dv = torch.empty_like(qt), torch.empty_like(kt), torch.empty_like(vt)
        call_by_name(
            self._interface._flash_attn_backward, dout=t(dout), q=qt, k=kt, v=vt, out=t(out),
            softmax_lse=lse.contiguous(), dq=dq, dk=dk, dv=dv, softmax_scale=scale, causal=causal,
            is_causal=causal,
        )
        return _bshd(dq), _bshd(dk), _bshd(dv)


class FlashAttnKernel(_FlashAttnBase):
    """flash-attn 2.x (``flash_attn.flash_attn_interface``)."""

    name = "flash_attn"

    def __init__(self) -> None:
        from flash_attn import flash_attn_interface  # noqa: PLC0415 - optional

        self._interface = flash_attn_interface


class FlashAttn3Kernel(_FlashAttnBase):
    """flash-attn 3.x (the top-level ``flash_attn_interface`` module of the hopper/ build)."""

    name = "flash_attn_3"

    def __init__(self) -> None:
        import flash_attn_interface  # noqa: PLC0415 - optional

        self._interface = flash_attn_interface
