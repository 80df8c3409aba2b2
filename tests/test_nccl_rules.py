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
    saw the P2P messages (the harness then found every pair's order matched)."""
    for first_op, messages in run_ranks(audited_attention_worker, 8, args=(2, True)):
        assert set(first_op) == {"startrail", "startrail_twin", "team", "cp", "cp_twin"}
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
