"""The block kernel is chosen once per layer call (issue 56, item 2).

On 3a17b64 ``startrail_attn`` chose its kernel twice: ``check_inputs`` asked
``kernels.check_kernel`` (a forced kernel's refusal before any communication) and the layer
asked ``kernels.kernel_for`` again where it made the kernel. Now the entry builds one
:class:`~megatron_startrail.kernels.LayerKernel` (the request, the choice, the kernel) and
carries it to the schedule.

One rank of a layer on torch's no-op process group (benchmarks/launch_budget's ``fake_rank``),
forward and backward, followed with ``sys.setprofile``: the calls of
``kernels.selection.choose_kernel`` (by its code object, whoever calls it), and every call
that crosses into ``megatron_startrail/kernels/`` from outside it. The schedule's calls of the
kernel's entries (from blocks.py: forward, backward, backward_into) are its work, not the way
there; every other crossing is on ``q``'s way from ``startrail_attn`` to the schedule.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from benchmarks.counters.launch_budget import fake_rank
from megatron_startrail import blocks, new_startrail_groups, startrail_attn
from megatron_startrail.kernels import selection

KERNELS_DIR = os.path.dirname(selection.__file__) + os.sep
PACKAGE_DIR = os.path.dirname(os.path.dirname(selection.__file__))
SCHEDULE = blocks.__file__


def _site(frame) -> str:
    return f"{os.path.relpath(frame.f_code.co_filename, PACKAGE_DIR)}:{frame.f_code.co_name}"


def _caller(frame):
    """The frame that called ``frame``, past generated code (a dataclass's ``__init__``: "<string>")."""
    caller = frame.f_back
    while caller is not None and caller.f_code.co_filename.startswith("<"):
        caller = caller.f_back
    return caller


def follow_layer(P, C, kernel="auto", ulysses=1, **layer):
    """One layer's forward + backward on rank 1 of ``P``: ``(choose_kernel calls, crossings into
    kernels/ that are not the schedule's kernel calls, as "caller -> callee", the names of the
    kernel's entries the schedule called)``."""
    chooses, crossings, scheduled = [], [], set()

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        caller = _caller(frame)
        if code is selection.choose_kernel.__code__:
            chooses.append(_site(caller))
        if (code.co_filename.startswith(KERNELS_DIR) and caller is not None
                and not caller.f_code.co_filename.startswith(KERNELS_DIR)):
            if caller.f_code.co_filename == SCHEDULE:
                scheduled.add(code.co_name)
            else:
                crossings.append(f"{_site(caller)} -> {_site(frame)}")

    with fake_rank(1, P):
        groups = new_startrail_groups(team_size=C, kernel=kernel, ulysses_size=ulysses)
        n = 8 * P
        q, k, v = (torch.randn(n, 1, 4, 16, requires_grad=True) for _ in range(3))
        sys.setprofile(profile)
        try:
            out = startrail_attn(q, k, v, groups, **layer)
            torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        finally:
            sys.setprofile(None)
    return chooses, crossings, scheduled


CASES = {
    "dense P2": dict(P=2, C=1),
    "dense P4 C2 reference": dict(P=4, C=2, kernel="reference"),
    "window, halo exchange": dict(P=4, C=1, window_size=(5, 0)),
    "window through the schedule": dict(P=4, C=2, window_size=(5, 0), halo_exchange=False),
    "packed documents": dict(P=4, C=2, cu_seqlens=torch.tensor([0, 20, 64, 128], dtype=torch.int32)),
    "Ulysses 2": dict(P=4, C=1, ulysses=2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_kernel_is_chosen_once_per_layer_call(case):
    chooses, crossings, scheduled = follow_layer(**CASES[case])
    print(f"\n{case}: choose_kernel called from {chooses}; into kernels/ on q's way: {crossings}; "
          f"the schedule called {sorted(scheduled)}")
    assert "forward" in scheduled and scheduled & {"backward", "backward_into"}, scheduled  # both were followed
    assert len(chooses) == 1, chooses
    # q enters the kernels package once on its way from startrail_attn to the schedule
    assert crossings == ["attention.py:layer_kernel -> kernels/__init__.py:choose_layer_kernel"], crossings
