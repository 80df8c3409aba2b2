"""A replay of each rank's communication program under NCCL's execution rules (CPU check).

gloo blocks the host on every wait and runs each group's operations on their own; NCCL
does neither. On a GPU each communicator runs its operations in posting order on its own
stream, an operation is enqueued behind the compute stream as it stands when posted (so it
starts only after everything the compute stream was made to wait for before that point),
and a wait makes the compute stream, not the host, wait. A program gloo runs can therefore
hang NCCL: rank A waits for communicator X before posting on Y while rank B waits for Y
before posting on X. NCCL-rules mode (:mod:`megatron_startrail.nccl_rules`) records every
rank's whole program -- posts per communicator, in NCCL's mapping of channels to
communicators, and waits -- and :func:`replay` runs it under these rules::

    an op (rank r, communicator X, posted at point t) starts when
        the previous op of r on X has completed                      (one FIFO stream per communicator)
        and every op r waited for before t has completed            (enqueued behind the compute stream)
    a batched P2P op completes when, for each of its sends and receives, the matching
        receive or send has started on the peer                     (the k-th send of a pair on X
                                                                      matches the k-th receive)
    a collective completes when every rank of the communicator has started its
        collective of the same index there                          (same label, else a mismatch)

and reports every op that never completes, with a cycle of what waits on what, and every
collective whose label differs across ranks (posted in different orders). Host syncs
inside a layer are not modelled (the layers have none; tests/megatron/test_host_syncs.py).

A program is a list of events on one rank, in posting order::

    ("post", op, comm, kind, detail)  comm: (name, ranks); kind "p2p": detail is a list of
                                      (peer, "send" | "recv", label, bytes); kind "coll": the label
    ("wait", ops)                     the compute stream waits for these ops
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class _Op:
    rank: int
    op: int  # id within the rank's program
    comm: tuple  # (name, ranks)
    kind: str
    detail: object
    waits_before: int = 0  # how many of this rank's waits came before this op was posted
    prev: _Op | None = None  # the previous op of this rank on this communicator
    partners: list = field(default_factory=list)  # ops of other ranks this one needs started
    started: bool = False
    done: bool = False

    def describe(self) -> str:
        what = self.detail if self.kind == "coll" else ", ".join(
            f"{d} {label} {'to' if d == 'send' else 'from'} rank {peer}" for peer, d, label, _ in self.detail)
        return f"rank {self.rank} {self.kind} on {self.comm[0]} {_ranks(self.comm[1])} ({what})"


def _ranks(ranks) -> str:
    """A communicator's ranks for a message: listed, or their span when there are many (scale replays)."""
    ranks = list(ranks)
    if len(ranks) <= 8:
        return str(ranks)
    consecutive = ranks == list(range(ranks[0], ranks[0] + len(ranks)))
    return f"[{ranks[0]}..{ranks[-1]}]" if consecutive else f"[{len(ranks)} ranks: {ranks[0]}, {ranks[1]}, ..., {ranks[-1]}]"


def _build(programs: dict[int, list]) -> tuple[dict, list[str]]:
    """The ops of every rank with their dependencies; mismatches found while matching."""
    ops: dict[tuple[int, int], _Op] = {}
    waited: dict[int, list] = {}  # rank -> the ops it waited for, in order (keys into ops)
    problems: list[str] = []
    last_on: dict[tuple[int, tuple], _Op] = {}
    p2p_queue: dict[tuple, list] = defaultdict(list)  # (comm, src, dst, dir) -> [(op, label, bytes)]
    colls: dict[tuple, list] = defaultdict(list)  # (comm, rank) -> [op]
    for rank, program in programs.items():
        mine = waited.setdefault(rank, [])
        for event in program:
            if event[0] == "wait":
                mine.extend((rank, o) for o in event[1])
                continue
            _, op_id, comm, kind, detail = event
            op = _Op(rank, op_id, comm, kind, detail, len(mine), last_on.get((rank, comm)))
            ops[(rank, op_id)] = op
            last_on[(rank, comm)] = op
            if kind == "coll":
                colls[(comm, rank)].append(op)
            else:
                for peer, direction, label, nbytes in detail:
                    src, dst = (rank, peer) if direction == "send" else (peer, rank)
                    p2p_queue[(comm, src, dst, direction)].append((op, label, nbytes))
    for (comm, src, dst, direction), sent in p2p_queue.items():
        if direction != "send":
            continue
        received = p2p_queue.get((comm, src, dst, "recv"), [])
        for k, (op, label, nbytes) in enumerate(sent):
            if k >= len(received):
                problems.append(f"rank {src}'s send #{k} to rank {dst} on {comm[0]} ({label}) has no receive: rank "
                                f"{dst} never posts it, and {op.describe()} waits for it")
                continue
            peer_op, peer_label, peer_bytes = received[k]
            if nbytes != peer_bytes:
                problems.append(f"{comm[0]} {_ranks(comm[1])}: send #{k} rank {src} -> {dst} ({label}, {nbytes} B) "
                                f"meets receive {peer_label} of {peer_bytes} B")
            op.partners.append(peer_op)
            peer_op.partners.append(op)
        for k in range(len(sent), len(received)):
            op, label, _ = received[k]
            problems.append(f"rank {dst}'s receive #{k} from rank {src} on {comm[0]} ({label}) has no send: rank "
                            f"{src} never posts it, and {op.describe()} waits for it")
    by_comm: dict[tuple, dict[int, list]] = defaultdict(dict)
    for (comm, rank), seq in colls.items():
        by_comm[comm][rank] = seq
    for comm, per_rank in by_comm.items():
        members = [r for r in comm[1] if r in programs]
        for k in range(max(len(s) for s in per_rank.values())):
            at = {r: per_rank.get(r, [])[k] if k < len(per_rank.get(r, [])) else None for r in members}
            labels = {r: (o.detail if o is not None else None) for r, o in at.items()}
            if len(set(labels.values())) > 1:
                problems.append(f"{comm[0]} {_ranks(comm[1])}: collective #{k} is {labels} by rank: posted in "
                                "different orders (NCCL runs a communicator's collectives in posting order)")
            for o in at.values():
                if o is not None:
                    o.partners.extend(p for p in at.values() if p is not None and p is not o)
    return ops, waited, problems


class _Waits:
    """Per rank, how many of its waits (in order) are on completed ops: an op posted after
    ``n`` waits may start once that count reaches ``n``."""

    def __init__(self, ops: dict, waited: dict) -> None:
        self.waited = {r: [ops.get(key) for key in keys] for r, keys in waited.items()}
        self.done = dict.fromkeys(waited, 0)

    def advance(self, rank: int) -> int:
        """The count of leading waits of ``rank`` on completed ops (skipping ops never posted)."""
        seq, i = self.waited[rank], self.done[rank]
        while i < len(seq) and (seq[i] is None or seq[i].done):
            i += 1
        self.done[rank] = i
        return i

    def first_pending(self, rank: int, n: int) -> _Op | None:
        """The first op among the rank's first ``n`` waits that has not completed (None: all have)."""
        i = self.advance(rank)
        return self.waited[rank][i] if i < n else None


def _blockers(op: _Op, waits: _Waits) -> list[_Op]:
    """What ``op`` is waiting for: before it starts, its stream and compute-stream
    dependencies; after, the partners that have not started."""
    if not op.started:
        deps = [op.prev] if op.prev is not None and not op.prev.done else []
        pending = waits.first_pending(op.rank, op.waits_before)
        return deps + ([pending] if pending is not None else [])
    return [p for p in op.partners if not p.started]


def _cycle(start: _Op, waits: _Waits) -> list[_Op]:
    """Follow the first blocker from ``start`` until an op repeats: the cycle."""
    path, seen, op = [], {}, start
    while op is not None and id(op) not in seen:
        seen[id(op)] = len(path)
        path.append(op)
        nxt = _blockers(op, waits)
        op = nxt[0] if nxt else None
    return path[seen[id(op)]:] if op is not None else path


def replay(programs: dict[int, list]) -> list[str]:
    """Run every rank's program under NCCL's rules; the problems found (empty: no hang)."""
    ops, waited, problems = _build(programs)
    waits = _Waits(ops, waited)
    by_rank: dict[int, list[_Op]] = defaultdict(list)  # program order
    for op in ops.values():
        by_rank[op.rank].append(op)
    released = dict.fromkeys(by_rank, 0)  # how many of a rank's ops (in order) have all their waits done
    next_on: dict[int, _Op] = {id(op.prev): op for op in ops.values() if op.prev is not None}
    unstarted = {id(op): len(op.partners) for op in ops.values()}
    done_queue: list[_Op] = []

    def try_start(op: _Op) -> None:
        if op.started or (op.prev is not None and not op.prev.done) or op.waits_before > waits.done[op.rank]:
            return
        op.started = True
        for partner in op.partners:
            unstarted[id(partner)] -= 1
            try_done(partner)
        try_done(op)

    def try_done(op: _Op) -> None:
        if op.started and not op.done and unstarted[id(op)] == 0:
            op.done = True
            done_queue.append(op)

    def release(rank: int) -> None:
        count, seq = waits.advance(rank), by_rank[rank]
        while released[rank] < len(seq) and seq[released[rank]].waits_before <= count:
            try_start(seq[released[rank]])
            released[rank] += 1

    for rank in by_rank:
        release(rank)
    while done_queue:
        op = done_queue.pop()
        if id(op) in next_on:
            try_start(next_on[id(op)])
        release(op.rank)
    stuck = [op for op in ops.values() if not op.done]
    if stuck:
        cycle = _cycle(stuck[0], waits)
        chain = "\n      -> ".join(("waits on " if i else "") + o.describe() + ("" if o.started else " [not started]")
                                  for i, o in enumerate(cycle + cycle[:1]))
        problems.append(f"NCCL would hang: {len(stuck)} operations never complete; a cycle:\n      {chain}")
    return problems
