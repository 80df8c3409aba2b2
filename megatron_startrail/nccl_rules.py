"""NCCL-rules mode: a CPU run (gloo) that obeys, and is checked against, NCCL's rules.

gloo forgives what NCCL does not: it matches P2P messages by tag, and it creates its
connections when a group is made, so a rank that never touches a group leaves nobody
waiting. On NCCL the k-th send between two ranks of a communicator matches the k-th
receive, and a group's first batched P2P must include all of its ranks. With
``STARTRAIL_CHECK_NCCL_RULES=1`` in the environment, :func:`new_startrail_groups`
gives its transport a :class:`RuleAudit` that records, on this rank:

- per group (by role) the kind of its first operation here: ``"collective"`` or ``"p2p"``;
- per group and peer, the sequence of messages sent and received: ``(label, bytes)``;

and it fails at once when a tensor handed to a collective or a P2P op is not contiguous
(NCCL moves the storage as one dense block: a strided view would be the wrong bytes).

:func:`verify` then checks across ranks (tests/multiproc.py calls it after every
distributed test, over the default group):

1. for every pair of ranks and group, what one posted to the other as sends equals, in
   order, what the other posted as receives (labels and sizes): the schedule never relies
   on tags (the transport sends none; tag 0 makes gloo match in posting order, like NCCL);
2. in every group where any rank ran a P2P, all its ranks' first operations are of one
   kind: all a collective (eager initialisation) or all the same first P2P batch.

3. the whole program of every rank -- each post on the communicator NCCL would use
   (:class:`~megatron_startrail.transport.NcclTransport`'s mapping of channels, whatever
   the backend here), each collective, each wait -- replayed under NCCL's execution rules
   (:mod:`megatron_startrail.nccl_replay`): no operation may wait forever, and every
   communicator's collectives come in the same order on all its ranks.

The audits of one process are kept in creation order (every rank creates its groups
collectively, in the same order, so audit ``i`` is the same groups on every rank).
This registry exists only in this mode, for the test harness.
"""

from __future__ import annotations

import functools
import os
from collections import defaultdict

import torch
import torch.distributed as dist

from .nccl_replay import replay

ENV = "STARTRAIL_CHECK_NCCL_RULES"
REPLAY_LOG = "STARTRAIL_NCCL_REPLAY_LOG"  # a file: one line per replayed run (for counting them)

_AUDITS: list[RuleAudit] = []  # this process's audits, in creation order (this mode only)
_PROGRAM: list[tuple] = []  # this process's posts and waits, in order (nccl_replay's events)
_WORK_OPS: dict[int, tuple[object, int]] = {}  # id(work) -> (work, op id) of the works not yet waited
_POSTS = [0]  # posts recorded since the last take_program (the next op id)
# A communicator's name in the program, by its process group's name (the same on every rank:
# groups are created collectively, in one order). One group serving several roles or group
# sets (a reused group, Note [communicators] in groups.py) is one communicator: one name, so
# the replay orders all its operations on one stream.
_NAMES: dict[str, str] = {}


def enabled() -> bool:
    return os.environ.get(ENV, "") == "1"


class RuleAudit:
    """What one rank did on the groups of one :class:`~megatron_startrail.groups.StarTrailGroups`."""

    def __init__(self, group_ranks: dict[str, tuple[int, ...]], groups: dict | None = None) -> None:
        self.index = len(_AUDITS)
        for role, group in (groups or {}).items():  # the first role naming a group names it
            if group is not None:
                name_group(group, f"{role}#{self.index}")
        self.group_ranks = group_ranks  # role -> global ranks of this rank's group of that role
        self.first_op: dict[str, str] = {}
        self.sent: dict[tuple[str, int], list] = defaultdict(list)  # (role, peer) -> [(label, bytes)]
        self.received: dict[tuple[str, int], list] = defaultdict(list)
        _AUDITS.append(self)

    def collective(self, role: str) -> None:
        self.first_op.setdefault(role, "collective")

    def p2p(self, role: str, peer: int, label: str, nbytes: int, *, send: bool) -> None:
        self.first_op.setdefault(role, "p2p")
        (self.sent if send else self.received)[(role, peer)].append((label, nbytes))

    def export(self) -> dict:
        return {"index": self.index, "group_ranks": self.group_ranks, "first_op": dict(self.first_op),
                "sent": dict(self.sent), "received": dict(self.received)}


def take_audits() -> list[RuleAudit]:
    """This process's audits so far, forgetting them (and the program recorded with them)."""
    audits = list(_AUDITS)
    _AUDITS.clear()
    return audits


def take_program() -> list[tuple]:
    """This process's recorded program so far (posts and waits), forgetting it."""
    program = list(_PROGRAM)
    _PROGRAM.clear()
    _NAMES.clear()
    _WORK_OPS.clear()
    _POSTS[0] = 0
    return program


def name_group(group, name: str) -> None:
    """Call ``group``'s communicator ``name`` in the program (unless it already has one)."""
    _NAMES.setdefault(group.group_name, name)


def comm_of(group) -> tuple:
    """``group``'s communicator as the program names it: (name, global ranks), the same on
    every rank; a group nobody named goes by torch's name for it."""
    ranks = tuple(dist.get_process_group_ranks(group))
    return (_NAMES.get(group.group_name, f"group:{group.group_name}"), ranks)


def record_collective(group, label: str, works) -> None:
    """Record a collective posted outside StarTrail's transport (Megatron's own: its gradient
    reduce, the hybrid-CP schedule's barrier), so the replay orders it with StarTrail's."""
    _record_post(comm_of(group), "coll", label, works)


def record_wait(works) -> None:
    """Record that the compute stream waits for ``works`` (posted through :func:`record_collective`)."""
    _record_wait(works if isinstance(works, list) else [works])


def record_megatron_grad_reduce() -> None:
    """Record Megatron's data-parallel gradient reduce as one more communicator (this mode
    only; idempotent; nothing when megatron's DDP is not imported): each bucket group's
    ``start_grad_sync`` -- its buckets' all-reduces or reduce-scatters over DP (x CP),
    coalesced into one NCCL group call, posted during the backward under
    ``--overlap-grad-reduce`` -- is one collective, and ``finish_grad_sync`` the wait for it
    (at once when not overlapped). Hooked at the bucket group, not at torch's all_reduce:
    inside Megatron's coalescing manager the per-bucket calls return no work to wait on."""
    import sys  # noqa: PLC0415

    module = sys.modules.get("megatron.core.distributed.param_and_grad_buffer")
    group_cls = getattr(module, "_ParamAndGradBucketGroup", None)
    if group_cls is None or getattr(group_cls, "_startrail_recorded", False):
        return
    start, finish = group_cls.start_grad_sync, group_cls.finish_grad_sync

    def start_grad_sync(self, *args, **kwargs):
        result = start(self, *args, **kwargs)
        config = self.ddp_config
        group = self.intra_distributed_optimizer_instance_group if config.use_distributed_optimizer \
            else self.data_parallel_group
        kind = "reduce_scatter" if config.use_distributed_optimizer else "all_reduce"
        handle = self.grad_reduce_handle  # None: it ran synchronously
        token = handle if handle is not None else object()
        name_group(group, "megatron_dp_grads")
        record_collective(group, f"megatron_grad_{kind} x{len(self.buckets)}", token)
        if handle is None:
            record_wait(token)
        return result

    def finish_grad_sync(self, *args, **kwargs):
        if self.grad_reduce_handle is not None:
            record_wait(self.grad_reduce_handle)
        return finish(self, *args, **kwargs)

    group_cls.start_grad_sync, group_cls.finish_grad_sync = start_grad_sync, finish_grad_sync
    group_cls._startrail_recorded = True


def _record_post(comm: tuple, kind: str, detail, works) -> None:
    op = _POSTS[0]
    _POSTS[0] += 1
    _PROGRAM.append(("post", op, comm, kind, detail))
    for w in works if isinstance(works, list) else [works]:
        if w is not None:
            _WORK_OPS[id(w)] = (w, op)


def _record_wait(works) -> None:
    ops = [_WORK_OPS.pop(id(w))[1] for w in works if w is not None and id(w) in _WORK_OPS]
    if ops:
        _PROGRAM.append(("wait", ops))


def _check_dense(label: str, tensors) -> None:
    """NCCL reads and writes a tensor's storage as one dense block whatever its strides (its
    P2P only warns), where gloo refuses some and copies others: a strided tensor handed to a
    collective or a P2P op is wrong bytes on a GPU, so it fails the CPU run here."""
    for t in tensors:
        if not t.is_contiguous():
            raise AssertionError(f"NCCL rules: {label} was handed a non-contiguous tensor of shape "
                                 f"{tuple(t.shape)}, strides {t.stride()}; NCCL would move the wrong bytes")


@functools.cache
def checked(transport_cls):
    """``transport_cls`` recording every operation into its audit."""

    class Checked(transport_cls):
        def __init__(self, groups, p2p_ranks, audit: RuleAudit) -> None:
            super().__init__(groups, p2p_ranks)
            self.audit = audit

        def post(self, sends, recvs, *, channel, label):
            _check_dense(label, [t for t, _ in sends + recvs])
            detail = []
            for tensors, send in ((sends, True), (recvs, False)):
                for t, peer in tensors:
                    src, dst = (self.position, peer) if send else (peer, self.position)
                    role = self.role_of(self.p2p_group(src, dst, channel))
                    nbytes = t.numel() * t.element_size()
                    self.audit.p2p(role, self.p2p_ranks[peer], label, nbytes, send=send)
                    detail.append((self.p2p_ranks[peer], "send" if send else "recv", label, nbytes))
            works = super().post(sends, recvs, channel=channel, label=label)
            _record_post(self._comm(self._nccl_group(channel)), "p2p", detail, works)
            return works

        def collective(self, fn, *args, group, label, **kwargs):
            _check_dense(label, [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)])
            self.audit.collective(self.role_of(group))
            work = super().collective(fn, *args, group=group, label=label, **kwargs)
            _record_post(self._comm(group), "coll", f"{label}:{getattr(fn, '__name__', fn)}", work)
            return work

        def wait(self, works, timeline=None, label=""):
            _record_wait(works)
            return super().wait(works, timeline, label)

        def _nccl_group(self, channel):
            """The group NCCL's transport puts a transfer of ``channel`` on (the twin for the side
            channel), whatever this backend does (gloo picks by direction)."""
            main, twin = self._main_and_twin()
            return twin if twin is not None and channel == "side" else main

        def _comm(self, group) -> tuple:
            """The communicator, the same name on every rank: the role and group set index of
            the first audit holding it (a group reused by a later set keeps its first name)."""
            return comm_of(group)

    Checked.__name__ = f"Checked{transport_cls.__name__}"
    return Checked


def verify(exports: list[list[dict]]) -> list[str]:
    """The violations of rules 1 and 2 in ``exports[rank]`` (every rank's audits, in order)."""
    problems = []
    counts = {len(e) for e in exports}
    if len(counts) != 1:
        return [f"ranks built different numbers of StarTrail group sets: {[len(e) for e in exports]}"]
    for index in range(counts.pop()):
        for rank, audits in enumerate(exports):
            audit = audits[index]
            for role, ranks in audit["group_ranks"].items():
                if rank != min(ranks):
                    continue  # each group checked once, by its lowest rank
                firsts = {m: exports[m][index]["first_op"].get(role) for m in ranks}
                if "p2p" in firsts.values() and len(set(firsts.values())) > 1:
                    problems.append(
                        f"group set {index}, {role} group {list(ranks)}: first operation per rank {firsts}; "
                        "NCCL needs every rank in a group's first P2P batch (or a collective on it first)")
            for (role, peer), messages in audit["sent"].items():
                got = exports[peer][index]["received"].get((role, rank), [])
                if got != messages:
                    problems.append(
                        f"group set {index}, {role} group: rank {rank} sent rank {peer} {messages}, but rank "
                        f"{peer} posted receives {got}; NCCL matches them in posting order, by size")
            for (role, peer), messages in audit["received"].items():
                if (role, rank) not in exports[peer][index]["sent"]:
                    problems.append(f"group set {index}, {role} group: rank {rank} waits for {messages} from rank "
                                    f"{peer}, which sent it nothing")
    return problems


def _posts_per_comm(programs: list[list]) -> dict[str, int]:
    """Posts by communicator name, summed over ranks and group sets ("team#3" counts as "team")."""
    counts: dict[str, int] = defaultdict(int)
    for program in programs:
        for event in program:
            if event[0] == "post":
                counts[event[2][0].split("#")[0]] += 1
    return dict(sorted(counts.items()))


def verify_across_ranks() -> None:
    """Gather every rank's audits and program over the default group and raise on any
    violation of rules 1-3 (collective over the default group; the records are forgotten)."""
    mine = ([a.export() for a in take_audits()], take_program())
    gathered: list = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, gathered, dst=0)  # checked once, on rank 0, and the verdict shared
    verdict = [None]
    if dist.get_rank() == 0:
        verdict[0] = verify([g[0] for g in gathered]) + replay({rank: g[1] for rank, g in enumerate(gathered)})
        if os.environ.get(REPLAY_LOG):  # how many runs were replayed, and their size (the suite's count)
            with open(os.environ[REPLAY_LOG], "a", encoding="utf-8") as f:
                f.write(f"{len(gathered)} ranks, {sum(len(g[1]) for g in gathered)} events; posts per "
                        f"communicator {_posts_per_comm([g[1] for g in gathered])}\n")
    dist.broadcast_object_list(verdict, src=0)
    problems = verdict[0]
    if problems:
        raise AssertionError("NCCL rules violated:\n  " + "\n  ".join(problems[:10]))
