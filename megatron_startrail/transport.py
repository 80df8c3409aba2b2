"""How the attention's messages travel: one transport object per set of StarTrail groups.

Every P2P transfer and collective of the attention goes through a :class:`Transport`
(accounting stays in :class:`~megatron_startrail.comm.Communicator`). The implementation
follows the process group's backend, never a flag (for a group of several backends, such as
"cpu:gloo,cuda:nccl", the backend of the device the attention runs on):

- :class:`GlooTransport` (CPU). gloo runs both directions of a rank pair on one TCP
  connection, where a pair exchange (one message each way) serialises; transfers to a
  lower position therefore take the *twin* group, a second group over the same ranks
  (the burst probe, ``benchmarks/results/burst_probe.md``: 3.4 MB/s on one connection, 6.4 on
  two, at 50 Mbit/s).
  A wait blocks the host; the timeline records host time.
- :class:`NcclTransport` (GPU). NCCL runs each direction on its own channel but all of
  one communicator's operations on one stream, in posting order. Transfers that must
  progress together therefore go on different communicators: the sub-ring's hops
  (channel ``"ring"``) on the StarTrail group; the initial send, its reverse and the
  gradient accumulators (channel ``"side"``) on the twin. A wait is a stream dependency
  (``Work.wait()`` makes the current stream wait; the host runs on), and the timeline
  records CUDA events.

NCCL's rules, which the schedule keeps on both backends (and which
:mod:`megatron_startrail.nccl_rules` checks on CPU):

1. **No tags.** Between two ranks of one communicator the k-th send matches the k-th
   receive, and their sizes must agree. Every message here has tag 0; a pair of ranks
   posts its sends and receives in the same order because every position runs the same
   program (:func:`~megatron_startrail.schedule.rotate`).
2. **Eager initialisation.** A group's first batched P2P must include all its ranks
   (NCCL creates the communicator collectively). :meth:`Transport.initialize` runs one
   collective on every group, on all its ranks, before any P2P; positions that never
   send (a sub-ring of one) then cannot leave the others waiting.
"""

from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist

# The groups of one StarTrailGroups, by role, in the order they are initialised (the same
# on every rank: each rank is in exactly one group of each role, so initialising them
# role by role cannot deadlock).
ROLES = ("ulysses", "startrail", "startrail_twin", "team", "cp", "cp_twin")
CHANNELS = ("ring", "side")
DEVICE_TYPES = ("cpu", "cuda", "meta")  # what a transport is chosen for (StarTrailGroups.transports_on; meta: launch counts)


class Transport:
    """P2P over a StarTrail group (peers as positions in it) and collectives on explicit groups.

    ``groups`` maps the roles of :data:`ROLES` to this rank's process groups (None: a group of
    one, or not built); ``p2p_ranks`` are the StarTrail group's global ranks in position order.
    P2P runs on the group of role ``p2p_roles[0]`` and its twin ``p2p_roles[1]``
    (:meth:`on` gives the same transport over the CP group, for the halo exchange).
    """

    backend = "base"

    def __init__(self, groups: dict, p2p_ranks: tuple[int, ...],
                 p2p_roles: tuple[str, str] = ("startrail", "startrail_twin")) -> None:
        self.groups = {role: groups.get(role) for role in ROLES}
        self.p2p_roles = p2p_roles
        self.p2p_ranks = tuple(p2p_ranks)
        me = dist.get_rank()
        self.position = self.p2p_ranks.index(me) if me in self.p2p_ranks else None

    def on(self, p2p_roles: tuple[str, str], p2p_ranks: tuple[int, ...]) -> Transport:
        """This transport (same groups, same audit) with P2P over the groups of ``p2p_roles``,
        whose global ranks in position order are ``p2p_ranks``."""
        other = copy.copy(self)
        other.p2p_roles, other.p2p_ranks = p2p_roles, tuple(p2p_ranks)
        other.position = other.p2p_ranks.index(dist.get_rank())
        return other

    # -- which group carries what -----------------------------------------------------
    def p2p_group(self, src: int, dst: int, channel: str):
        """The group carrying a transfer from position ``src`` to ``dst`` on ``channel``."""
        raise NotImplementedError

    def _main_and_twin(self):
        return self.groups[self.p2p_roles[0]], self.groups[self.p2p_roles[1]]

    def role_of(self, group) -> str:
        for role, g in self.groups.items():
            if g is group:
                return role
        return "other"

    # -- operations: each returns the started works --------------------------------------
    def post(self, sends, recvs, *, channel: str, label: str) -> list:
        """Start sends ``(tensor, dst position)`` and receives ``(buffer, src position)``:
        one ``batch_isend_irecv`` per group, all tag 0 (rule 1)."""
        assert channel in CHANNELS, channel
        batches: dict = {}
        for t, peer in sends:
            group = self.p2p_group(self.position, peer, channel)
            batches.setdefault(group, []).append(dist.P2POp(dist.isend, t, group=group, group_peer=peer))
        for t, peer in recvs:
            group = self.p2p_group(peer, self.position, channel)
            batches.setdefault(group, []).append(dist.P2POp(dist.irecv, t, group=group, group_peer=peer))
        return [w for batch in batches.values() for w in dist.batch_isend_irecv(batch)]

    def collective(self, fn, *args, group, label: str, **kwargs):
        """Start collective ``fn(*args, group=group, **kwargs)``; returns its work."""
        return fn(*args, group=group, async_op=True, **kwargs)

    def wait(self, works: list, timeline=None, label: str = "") -> None:
        """Complete ``works`` (how: by backend), recording the wait in ``timeline``."""
        raise NotImplementedError

    # -- set-up ----------------------------------------------------------------------------
    def device(self) -> torch.device:
        """Where this backend's tensors live (the eager initialisation's tensor)."""
        return torch.device("cpu")

    def initialize(self) -> None:
        """Rule 2: one tiny all-reduce on every group of this rank, role by role (collective)."""
        done = []
        for role in ROLES:
            group = self.groups[role]
            if group is not None and not any(group is g for g in done):  # a group serving two roles: once
                done.append(group)
                self.wait([self.collective(dist.all_reduce, torch.zeros(1, device=self.device()), group=group,
                                           label="initialize")])


class GlooTransport(Transport):
    """CPU: transfers to a lower position take the twin group (their own connection)."""

    backend = "gloo"

    def p2p_group(self, src, dst, channel):
        main, twin = self._main_and_twin()
        return twin if twin is not None and dst < src else main

    # A peer that raised or died, or one stuck past the group's timeout, surfaces on this rank as
    # gloo's RuntimeError, which names neither the operation nor the schedule; and it surfaces
    # where this rank next touches that peer's connection: in a wait, or already in posting a
    # send once gloo has seen the connection close (``isend`` raises then; which of the two a
    # rank meets depends on timing). Both say which StarTrail operation it was, so that every
    # rank's report reads the same way whichever it met.
    def post(self, sends, recvs, *, channel, label):
        try:
            return super().post(sends, recvs, channel=channel, label=label)
        except RuntimeError as error:
            raise _peer_failed(label, "posting a transfer", error) from error

    def wait(self, works, timeline=None, label=""):
        if not works:
            return
        start = time.perf_counter()
        try:
            for w in works:
                w.wait()  # gloo: blocks the host until done
        except RuntimeError as error:
            raise _peer_failed(label, "waiting for a peer", error) from error
        if timeline is not None:
            timeline.add(label, start, time.perf_counter())


def _peer_failed(label: str, doing: str, error: RuntimeError) -> RuntimeError:
    """gloo's ``error`` in StarTrail operation ``label``, met while ``doing`` (see GlooTransport)."""
    return RuntimeError(f"StarTrail {label or 'communication'} failed on this rank, {doing} (a peer that raised "
                        f"or died, or the process group's timeout): {error}")


class NcclTransport(Transport):
    """GPU: the side channel on the twin communicator; waits are stream dependencies."""

    backend = "nccl"

    def p2p_group(self, src, dst, channel):
        main, twin = self._main_and_twin()
        return twin if twin is not None and channel == "side" else main

    def device(self):
        return torch.device("cuda", torch.cuda.current_device())

    def wait(self, works, timeline=None, label=""):
        if not works:
            return
        start = torch.cuda.Event(enable_timing=True) if timeline is not None else None
        if start is not None:
            start.record()
        for w in works:
            w.wait()  # NCCL: the current stream waits for the communication stream; the host does not
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            timeline.add_events(label, start, end)


TRANSPORTS = {"gloo": GlooTransport, "nccl": NcclTransport}


def backend_for_device(backend: str, device_type: str) -> str:
    """The backend that carries ``device_type`` tensors in a process group's backend string:
    "gloo" and "nccl" carry every device; a group created for several devices reports them
    as pairs, "cpu:gloo,cuda:nccl" (``dist.get_backend``), and each device's tensors take
    the backend of their pair. ValueError naming the string when none is for ``device_type``."""
    if ":" not in backend:
        return backend
    pairs = dict(part.strip().split(":", 1) for part in backend.split(","))
    if device_type not in pairs:
        raise ValueError(f"StarTrail's attention runs on {device_type} tensors, but its process group's backend "
                         f"{backend!r} has none for {device_type} (it has: {', '.join(sorted(pairs))}); create the "
                         f"groups with a backend for {device_type} (gloo for cpu, nccl for cuda)")
    return pairs[device_type]


def default_device_type() -> str:
    """Where Megatron runs when nothing says otherwise: cuda when this process sees a GPU, else
    cpu. Only for choices made before any tensor exists (group creation, eager initialisation);
    the attention itself goes by its tensors' device (``StarTrailGroups.transports_on``)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def group_backend(group=None, device_type: str | None = None) -> str:
    """The backend that carries the attention's tensors on ``group`` (default: the default
    group), for ``device_type`` (default: cuda when there is a GPU, as Megatron runs; else
    cpu): "gloo", "nccl", or what a mixed string such as "cpu:gloo,cuda:nccl" names for it.
    Every choice that depends on the backend (the transport, NCCL group options, the twin
    groups) asks here, so a mixed string means the same thing to all of them."""
    device_type = device_type or default_device_type()
    reported = str(dist.get_backend(group)).lower()
    # torch's no-op group (e.g. "cpu:fake,meta:fake"): one process standing in for any rank (benchmarks/gpu/check)
    if "fake" in reported:
        return "nccl" if device_type == "cuda" else "gloo"
    return backend_for_device(reported, device_type)


def transport_for(groups: dict, p2p_ranks: tuple[int, ...], audit=None, device_type: str | None = None) -> Transport:
    """The transport of the StarTrail group's backend for ``device_type`` (:func:`group_backend`).
    With ``audit``, a :class:`~megatron_startrail.nccl_rules.RuleAudit`, every operation is
    checked against NCCL's rules as well."""
    backend = group_backend(groups.get("startrail"), device_type)
    cls = TRANSPORTS.get(backend)
    if cls is None:
        raise ValueError(f"StarTrail has no transport for the {backend!r} backend (the group reports "
                         f"{dist.get_backend(groups.get('startrail'))!r}); use gloo (CPU) or nccl (GPU)")
    if audit is not None:
        from .nccl_rules import checked  # noqa: PLC0415 - the checking mode only

        cls = checked(cls)
        return cls(groups, p2p_ranks, audit)
    return cls(groups, p2p_ranks)
