"""NCCL-rules mode (megatron_startrail/nccl_rules.py): the suite runs in it, and it catches
the two bugs gloo forgives and NCCL does not -- sends to one peer posted in another order
than the peer's receives, and a rank missing a group's first batched P2P."""

import os

import pytest
import torch
import torch.distributed as dist

from megatron_startrail import nccl_rules, new_startrail_groups, startrail_attn
from megatron_startrail.comm import CommStats, Communicator
from tests.multiproc import run_ranks


def test_the_suite_runs_in_nccl_rules_mode():
    assert nccl_rules.enabled(), "tests/conftest.py sets STARTRAIL_CHECK_NCCL_RULES=1 for the whole suite"
    assert os.environ[nccl_rules.ENV] == "1"


def audited_attention_worker(rank, world_size, team_size, eager_init):
    groups = new_startrail_groups(team_size=team_size, eager_init=eager_init)
    gen = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(8, 1, 2, 4, generator=gen, requires_grad=True) for _ in range(3))
    startrail_attn(q, k, v, groups).sum().backward()
    audit = groups.transport.audit
    return audit.first_op, sum(len(m) for m in audit.sent.values())


def test_startrail_runs_are_audited_and_obey_the_rules():
    """P = 8, C = 2: every group's first operation is the eager collective, and the audit
    saw the P2P messages (the harness then found every pair's order matched). Without
    Ulysses the StarTrail group and its twin are the CP group's (Note [communicators])."""
    for first_op, messages in run_ranks(audited_attention_worker, 8, args=(2, True)):
        assert set(first_op) == {"startrail", "startrail_twin", "team"}
        assert set(first_op.values()) == {"collective"}
        assert messages > 0


def test_a_rank_missing_a_groups_first_p2p_batch_is_caught():
    """P = 4, C = 2: the sub-ring has one rank and positions 0 and 3 send their initial send to
    themselves, so without eager initialisation they never touch the P2P groups while 1 and 2
    open them with a batched P2P (on NCCL: 1 and 2 would wait forever for the communicator)."""
    with pytest.raises(AssertionError, match="NCCL needs every rank in a group's first P2P batch") as caught:
        run_ranks(audited_attention_worker, 4, args=(2, False))
    assert "first operation per rank {0: None, 1: 'p2p', 2: 'p2p', 3: None}" in str(caught.value)
    run_ranks(audited_attention_worker, 4, args=(2, True))  # with eager initialisation: obeyed


def swapped_order_worker(rank, world_size, swap):
    """Rank 0 sends a payload message then an accumulator message to rank 1 (equal sizes);
    rank 1 posts its receives in that order, or swapped (the planted bug)."""
    groups = new_startrail_groups(team_size=1)
    comm = Communicator(CommStats(), groups.transport)
    payload, accumulator = torch.full((16,), 1.0), torch.full((16,), 2.0)
    if rank == 0:
        first = comm.post([(payload, 1)], [], op="payload")
        second = comm.post([(accumulator, 1)], [], op="accumulator", channel="ring")
    else:
        got_payload, got_accumulator = torch.empty(16), torch.empty(16)
        order = [("accumulator", got_accumulator), ("payload", got_payload)] if swap else \
            [("payload", got_payload), ("accumulator", got_accumulator)]
        first, second = (comm.post([], [(buf, 0)], op=op) for op, buf in order)
    first.wait()
    second.wait()
    dist.barrier()
    return None if rank == 0 else (got_payload[0].item(), got_accumulator[0].item())


def test_sends_posted_in_another_order_than_the_receives_are_caught():
    """NCCL (and gloo without tags) matches by posting order: the swapped receives get each
    other's data, silently; the audit names the pair and both sequences."""
    assert run_ranks(swapped_order_worker, 2, args=(False,))[1] == (1.0, 2.0)
    with pytest.raises(AssertionError, match="NCCL matches them in posting order") as caught:
        run_ranks(swapped_order_worker, 2, args=(True,))
    assert ("rank 0 sent rank 1 [('payload', 64), ('accumulator', 64)], but rank 1 posted receives "
            "[('accumulator', 64), ('payload', 64)]") in str(caught.value)


def test_verify_checks_each_rule_on_recorded_runs():
    """The cross-rank check on hand-made records: matched orders pass; a wait for a message
    nobody sent, and mixed first operations, are reported."""
    def audit(first_op, sent=None, received=None):
        return {"index": 0, "group_ranks": {"startrail": (0, 1)}, "first_op": first_op,
                "sent": sent or {}, "received": received or {}}

    ok = [[audit({"startrail": "p2p"}, sent={("startrail", 1): [("hop", 8)]})],
          [audit({"startrail": "p2p"}, received={("startrail", 0): [("hop", 8)]})]]
    assert nccl_rules.verify(ok) == []
    orphan = [[audit({"startrail": "collective"})],
              [audit({"startrail": "collective"}, received={("startrail", 0): [("hop", 8)]})]]
    assert any("which sent it nothing" in p for p in nccl_rules.verify(orphan))
    mixed = [[audit({"startrail": "collective"})], [audit({"startrail": "p2p"})]]
    assert any("first operation per rank" in p for p in nccl_rules.verify(mixed))


# -- rule 3: the whole program replayed under NCCL's execution rules (nccl_replay) -----------


def split_batch_worker(rank, world_size, planted):
    """Two ranks exchange one message each way on the side channel (one communicator on
    NCCL). Right: one post (one batched P2P). Planted: the receive and the send as two posts
    -- gloo runs it (it puts the two directions on two groups and waits for neither before
    posting the other); on NCCL each rank's receive heads the communicator's stream and
    waits for the peer's send, which is queued behind the peer's own receive."""
    transport = new_startrail_groups(team_size=1).transport
    out, buf = torch.full((4,), float(rank)), torch.empty(4)
    peer = 1 - rank
    if planted:
        works = transport.post([], [(buf, peer)], channel="side", label=f"to {rank}")
        works += transport.post([(out, peer)], [], channel="side", label=f"to {peer}")
    else:
        works = transport.post([(out, peer)], [(buf, peer)], channel="side", label="exchange")
    transport.wait(works)
    dist.barrier()
    return buf[0].item(), _verdict()


def _verdict() -> str | None:
    """The rules mode's verdict on this run so far, as the message it fails with (None: obeyed);
    the records are then gone, so the harness's own check after the worker passes."""
    try:
        nccl_rules.verify_across_ranks()
    except AssertionError as error:
        return str(error)
    return None


def test_an_exchange_split_in_two_batches_is_caught():
    """gloo runs both programs and delivers the data; the replay passes the one batched
    exchange and names the cycle of the planted one."""
    for rank, (got, error) in enumerate(run_ranks(split_batch_worker, 2, args=(False,))):
        assert got == 1 - rank and error is None
    for rank, (got, error) in enumerate(run_ranks(split_batch_worker, 2, args=(True,))):
        assert got == 1 - rank, "gloo ran it"
        assert "NCCL would hang: 4 operations never complete; a cycle:" in error
        assert "rank 0 p2p on startrail_twin#0 [0, 1] (recv to 0 from rank 1)" in error


def collective_order_worker(rank, world_size, planted):
    """Two all-reduces of one size on the StarTrail group (collectives #1 and #2 there: #0 is
    the eager initialisation); planted: rank 1 posts them in the other order (gloo reduces
    the wrong tensors together, silently)."""
    transport = new_startrail_groups(team_size=1).transport
    first, second = torch.full((4,), 1.0 + rank), torch.full((4,), 10.0 + rank)
    order = [("grads", first), ("stats", second)]
    if planted and rank == 1:
        order.reverse()
    works = [transport.collective(dist.all_reduce, t, group=transport.groups["startrail"], label=label)
             for label, t in order]
    transport.wait(works)
    return first[0].item(), _verdict()


def test_a_collective_posted_in_different_orders_is_caught():
    assert run_ranks(collective_order_worker, 2, args=(False,)) == [(3.0, None), (3.0, None)]
    results = run_ranks(collective_order_worker, 2, args=(True,))
    assert results[0][0] == 12.0, "gloo summed rank 0's grads with rank 1's stats"
    for _, error in results:
        assert ("startrail#0 [0, 1]: collective #1 is {0: 'grads:all_reduce', 1: 'stats:all_reduce'} by rank: "
                "posted in different orders") in error


def test_replay_on_hand_made_programs():
    """The replay's rules one at a time: FIFO per communicator, waits before a post, matching
    by order, collectives by index; sizes that differ are reported."""
    from megatron_startrail.nccl_replay import replay

    x, y = ("x", (0, 1)), ("y", (0, 1))

    def p2p(op, comm, peer, direction, nbytes=4):
        return ("post", op, comm, "p2p", [(peer, direction, "m", nbytes)])

    # Posting both before waiting never hangs, whatever the communicators.
    assert replay({0: [p2p(0, x, 1, "send"), p2p(1, y, 1, "recv"), ("wait", [0, 1])],
                   1: [p2p(0, y, 0, "send"), p2p(1, x, 0, "recv"), ("wait", [0, 1])]}) == []
    # One communicator is one stream: rank 1 receiving in the other order than rank 0 sends
    # on two communicators is fine, on one it is a hang (the first receive waits for a send
    # queued behind the second).
    assert replay({0: [p2p(0, x, 1, "send"), p2p(1, y, 1, "send")],
                   1: [p2p(0, y, 0, "recv"), p2p(1, x, 0, "recv")]}) == []
    assert any("never complete" in p for p in replay({
        0: [p2p(0, x, 1, "send"), p2p(1, x, 1, "recv")],
        1: [p2p(0, x, 0, "send"), ("wait", [0]), p2p(1, x, 0, "recv")]}))
    assert any("meets receive" in p for p in replay({0: [p2p(0, x, 1, "send", 4)], 1: [p2p(0, x, 0, "recv", 8)]}))
    assert any("has no receive" in p for p in replay({0: [p2p(0, x, 1, "send")], 1: []}))
    # The cross-communicator wait-before-post cycle: rank 0 waits for its send on x before
    # posting its receive on y, rank 1 the other way round. (gloo hangs on this one too, its
    # sends complete only when received, so it is planted here as a recorded program.)
    cycle = replay({0: [p2p(0, x, 1, "send"), ("wait", [0]), p2p(1, y, 1, "recv"), ("wait", [1])],
                    1: [p2p(0, y, 0, "send"), ("wait", [0]), p2p(1, x, 0, "recv"), ("wait", [1])]})
    assert len(cycle) == 1 and cycle[0].startswith("NCCL would hang: 4 operations never complete; a cycle:")
    assert "rank 0 p2p on x [0, 1] (send m to rank 1)\n      -> waits on rank 1 p2p on x [0, 1] (recv m from rank 0)" \
        " [not started]\n      -> waits on rank 1 p2p on y [0, 1] (send m to rank 0)" in cycle[0]
    # A collective waits for every rank of its communicator.
    coll = lambda op, comm: ("post", op, comm, "coll", "sum")  # noqa: E731
    assert replay({0: [coll(0, x)], 1: [coll(0, x)]}) == []
    assert any("never complete" in p for p in replay({0: [coll(0, x), ("wait", [0]), coll(1, y)],
                                                      1: [coll(0, y), ("wait", [0]), coll(1, x)]}))
