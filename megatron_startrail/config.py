"""What one StarTrail run is configured with, as one object.

A :class:`StarTrailConfig` is fixed when the StarTrail groups are built
(:func:`~megatron_startrail.new_startrail_groups`, or from Megatron's flags in
:mod:`megatron_startrail.megatron.from_args`) and travels with them
(``StarTrailGroups.config``) to every attention call and to Megatron's core attention:
one way in, so a flag cannot reach one layer and miss another. Team size and Ulysses
degree shape the groups themselves; the rest chooses how the attention runs on them.
"""

from __future__ import annotations

from dataclasses import dataclass

from .kernels.selection import KERNELS

BACKWARD_ROTATIONS = ("auto", "q", "kv")
TRANSFERS = ("ring", "multiring")


@dataclass(frozen=True)
class StarTrailConfig:
    """StarTrail's settings (the Megatron flag of each in brackets)."""

    team_size: int = 1  # C [--startrail-team-size]
    ulysses_size: int = 1  # U [--ulysses-degree-in-cp]
    backward_rotation: str = "auto"  # what circulates in the backward [--startrail-backward-rotation]
    transfer: str = "ring"  # the sub-ring, or TASP's multi-ring [--startrail-transfer; tasp: multiring]
    regather_in_backward: bool = False  # keep ring attention's tensors only [--startrail-regather-in-backward]
    kernel: str = "auto"  # block kernel [--startrail-kernel]
    # Deterministic block-kernel backward where the kernel has a switch for it (flash-attn);
    # PyTorch's own ops follow torch.use_deterministic_algorithms, which the flag sets
    # [--deterministic-mode]
    deterministic: bool = False
    # Under Megatron's recomputation, run the attention's forward again (communication
    # included) instead of taking the output and graph kept from the first forward
    # (Note [attention kept through recomputation]) [--startrail-recompute-attention]
    recompute_attention: bool = False
    # Piece-major rotation "q": each piece's dK, dV fly back while the next piece computes; False:
    # only where that raises no peak (Note [reverse overlap] in initial_send.py) [--startrail-no-reverse-overlap]
    reverse_overlap: bool = True

    def __post_init__(self) -> None:
        for name, flag in (("team_size", "--startrail-team-size"), ("ulysses_size", "--ulysses-degree-in-cp")):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} ({flag}) must be a positive integer")
        for name, flag, allowed in (("backward_rotation", "--startrail-backward-rotation", BACKWARD_ROTATIONS),
                                    ("transfer", "--startrail-transfer", TRANSFERS),
                                    ("kernel", "--startrail-kernel", KERNELS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} ({flag}) is not one of {allowed}")
        for name, flag in (("regather_in_backward", "--startrail-regather-in-backward"),
                           ("reverse_overlap", "--startrail-no-reverse-overlap"),
                           ("deterministic", "--deterministic-mode"),
                           ("recompute_attention", "--startrail-recompute-attention")):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} ({flag}) must be a bool")
