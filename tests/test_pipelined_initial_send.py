"""The initial send is pipelined into sub-ring step 0, and its reverse into the last step.

On gloo ranks, one event log per rank records, in order: every P2P post (by op), every
blocking wait (through a Timeline, by op) and every block-kernel call. On a rank whose
initial send comes from elsewhere, the first piece must be attended (and passed on to
the sub-ring's next position) before the last of the ``C`` pieces has been waited on;
with ``regather_in_backward`` the same holds for the backward's initial send, and with
rotation "q" the first piece of dK, dV goes back before the last block backward runs.
Results are checked against float64 full attention, bytes and steps against the closed
forms.
"""

import pytest
import torch

import megatron_startrail.blocks as blocks
from megatron_startrail import new_startrail_groups, startrail_attn
from megatron_startrail.accounting import AttentionShape, expected_comm
from megatron_startrail.comm import Communicator
from megatron_startrail.timeline import Timeline
from tests.attention_cases import TOLERANCE, full_inputs, local_rows, reference_with_grads, relative_error
from tests.multiproc import run_ranks

BATCH, HEADS, KV_HEADS, DIM, CHUNK = 1, 4, 2, 8, 4


class EventTimeline(Timeline):
    """A Timeline that also appends ``("wait", op)`` to a shared event log."""

    def __init__(self, events: list) -> None:
        super().__init__()
        self.events = events

    def add(self, op: str, start: float, end: float) -> None:
        super().add(op, start, end)
        self.events.append(("wait", op))


def record_events(events: list) -> None:
    """In this (forked) rank only: log every post and every block-kernel call."""
    post, forward_step, backward_step = Communicator.post, blocks.forward_step, blocks.backward_step

    def logged_post(self, sends, recvs, *, op, **kwargs):
        events.append(("post", op))
        return post(self, sends, recvs, op=op, **kwargs)

    def logged_forward(*args, **kwargs):
        events.append(("kernel", "forward"))
        return forward_step(*args, **kwargs)

    def logged_backward(*args, **kwargs):
        events.append(("kernel", "backward"))
        return backward_step(*args, **kwargs)

    Communicator.post = logged_post
    blocks.forward_step, blocks.backward_step = logged_forward, logged_backward


def first(events, event):
    return events.index(event)


def last(events, event):
    return len(events) - 1 - events[::-1].index(event)


def pipelining_worker(rank, world_size, team_size):
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True  # NaN-poisoned empty memory
    events: list = []
    record_events(events)
    failures = []
    seq = 2 * world_size * CHUNK
    full = full_inputs(23 + world_size, seq, BATCH, HEADS, KV_HEADS, DIM, torch.float32)
    ref = [local_rows(t, rank, world_size) for t in reference_with_grads(*full, True, DIM**-0.5)]
    for rotation in ("q", "kv"):
        groups = new_startrail_groups(team_size=team_size, backward_rotation=rotation)
        topo, pos = groups.topology, groups.startrail_rank
        receives_elsewhere = topo.init_send_dst(pos) != pos
        case = f"P={world_size} C={team_size} rotation={rotation} position={pos}"
        q, k, v, dout = (local_rows(t, rank, world_size).float() for t in full)
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))

        events.clear()
        out = startrail_attn(q, k, v, groups, causal=True, softmax_scale=DIM**-0.5, regather_in_backward=True,
                             timeline=EventTimeline(events))
        fwd, events[:] = list(events), []
        out.backward(dout)
        bwd = list(events)

        for name, got, want in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), ref):
            err = relative_error(got, want)
            if not err <= TOLERANCE[torch.float32]:  # also catches NaN
                failures.append(f"{case}: {name} error {err:.3g}")
        shape = AttentionShape(2 * CHUNK, BATCH, HEADS, KV_HEADS, DIM, 4)
        want = expected_comm(shape, cp_size=world_size, team_size=team_size, startrail_rank=pos,
                             rotation=rotation, regather_in_backward=True)
        for phase, stats in (("forward", groups.last_forward_stats), ("backward", groups.last_backward_stats)):
            for field, value in want[phase].items():
                if getattr(stats, field) != value:
                    failures.append(f"{case}: {phase} {field} {getattr(stats, field)} != {value}")

        for phase, log, send_op, kernel in (("forward", fwd, "init_send", ("kernel", "forward")),
                                            ("backward", bwd, "regather_init_send", ("kernel", "backward"))):
            piece_waits = log.count(("wait", send_op))
            if piece_waits != (team_size if receives_elsewhere else 0):
                failures.append(f"{case}: {phase} waited {piece_waits} times on {send_op}, want one per piece")
                continue
            if not receives_elsewhere:
                continue
            if not first(log, kernel) < last(log, ("wait", send_op)):
                failures.append(f"{case}: {phase} attends nothing before the last piece of {send_op} is here")
            if topo.sub_ring_size > 1 and not first(log, ("post", "sub_ring")) < last(log, ("wait", send_op)):
                failures.append(f"{case}: {phase} passes nothing on before the last piece of {send_op} is here")
        if receives_elsewhere and rotation == "q":
            if not first(bwd, ("post", "init_send_reverse")) < last(bwd, ("kernel", "backward")):
                failures.append(f"{case}: dK, dV go back only after the last block backward")
        if receives_elsewhere and bwd.count(("post", "init_send_reverse")) != team_size:
            failures.append(f"{case}: dK, dV went back in {bwd.count(('post', 'init_send_reverse'))} pieces")
    return failures, receives_elsewhere


@pytest.mark.parametrize("world_size,team_size", [(4, 2), (8, 2)])  # G = 1 (no hop) and G = 2
def test_initial_send_is_consumed_piece_by_piece(world_size, team_size):
    results = run_ranks(pipelining_worker, world_size, args=(team_size,))
    failures = [f for fails, _ in results for f in fails]
    assert not failures, "\n".join(failures[:40])
    assert sum(elsewhere for _, elsewhere in results) >= world_size // 2  # the checks ran on some ranks
