"""Where ``torch.compile`` stops: StarTrail's attention runs eagerly inside a compiled model.

Note [graph break at the attention]
-----------------------------------
``torch.compile`` around a model (or a function) that calls StarTrail traces everything up to
the attention, runs the attention as ordinary eager code (a graph break), and traces again after
it. The attention is not a registered custom op with a fake implementation because what it does
between the kernels is not a function of tensor shapes that a graph can hold:

* it talks to the other ranks: team all-gathers, the initial send, the sub-ring's P2P steps,
  the team reduce-scatter, in an order each rank computes on the host from its position;
* with packed documents it agrees on the documents across ranks (one small collective, one host
  read of ``cu_seqlens``) and plans its kernel calls on the host, per micro-batch
  (:mod:`megatron_startrail.microbatch`);
* its backward picks a rotation, may regather, and under Megatron's recomputation keeps the first
  pass's graph (:mod:`megatron_startrail.megatron.kept_attention`), which looks at the autograd
  node being run.

A graph cannot capture any of this without fixing the ranks' host decisions at trace time, and a
trace that differs between ranks (one rank recompiling, one not) would make them part ways in the
middle of a collective. With the graph break every rank runs exactly the eager schedule, the
tensors around it are compiled, and the gradients are the eager ones (tests/test_compile.py,
tests/megatron/test_compile_megatron.py). What it costs: one graph break per attention layer, the
attention's own launches uncompiled (they are fused kernels already).

Eager calls check :func:`torch.compiler.is_compiling` only (no dynamo import, no eval-frame
switch); under tracing the call goes to a ``torch._disable_dynamo`` wrapper, which imports dynamo
lazily (it is imported then anyway) and is what torch uses itself for the same purpose.
"""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)


def compile_boundary(fn: F) -> F:
    """``fn`` as a graph break under ``torch.compile`` (Note [graph break at the attention]);
    unchanged in eager mode."""
    eager_under_dynamo = torch._disable_dynamo(fn)

    @functools.wraps(fn)
    def entry(*args, **kwargs):
        if torch.compiler.is_compiling():  # dynamo is tracing the caller: leave the graph here
            return eager_under_dynamo(*args, **kwargs)
        return fn(*args, **kwargs)

    return entry
