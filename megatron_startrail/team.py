"""Phases 1-2 of StarTrail, shared by the forward and the regathering backward: the team
all-gather and the initial send (docs/design.md, "The forward, phase by phase"), and the
rows a team's gathered sequence holds."""

from __future__ import annotations

import torch

from .comm import Communicator
from .groups import StarTrailGroups
from .initial_send import post_initial_send
from .layout import Documents, Segment, rows_of_cp_ranks


def team_segments(groups: StarTrailGroups, docs: Documents, team: int) -> tuple[Segment, ...]:
    """The rows of a team's gathered sequence as segments (members in order, each member
    holding the CP ranks of its Ulysses group in order)."""
    u = groups.ulysses_size
    cp_ranks = tuple(p * u + i for p in groups.topology.team_positions(team) for i in range(u))
    return rows_of_cp_ranks(docs, cp_ranks)


def gather_team_and_send(comm: Communicator, groups: StarTrailGroups, q, k, v, *, gather_op: str, send_op: str,
                         gather_q: bool = True):
    """Phases 1-2, overlapped. Team all-gather: ``q [n, b, h, dqk]``, ``k [n, b, hkv, dqk]``,
    ``v [n, b, hkv, dv]`` -> ``q_team [C*n, b, h, dqk]``, ``kv_team [C*n, b, hkv, dqk + dv]``;
    initial send (paper Alg. 2) of ``kv_team`` to ``init_send_dst``, in ``C`` pieces. Returns
    ``q_team`` and ``kv_init``, what this rank starts the sub-ring with, still landing (a
    :class:`PieceTransfer`; ``kv_team`` itself when the send maps the rank to itself).

    Both gathers start at once, K, V first: the initial send needs only them, so it goes
    out while Q is still being gathered. K and V travel side by side in the last dim, so
    V keeps its own head dim (MLA). ``gather_q=False`` (the backward with rotation "q",
    which takes the team's queries member by member) gathers K, V only; ``q_team`` is None."""
    c = groups.team_size
    kv_gather = comm.all_gather(torch.cat([k, v], dim=-1), groups.team_group, c, op=gather_op, wait=False)
    q_gather = comm.all_gather(q, groups.team_group, c, op=gather_op, wait=False) if gather_q else None
    kv_init = post_initial_send(comm, groups.topology, groups.startrail_rank, kv_gather.wait(), op=send_op)
    return (q_gather.wait() if gather_q else None), kv_init
