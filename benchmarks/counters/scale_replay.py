"""Every rank's program at scale, replayed under NCCL's rules (issue 38, item 3).

One process stands in for each rank of ``P`` in turn (torch's no-op ``fake`` process group,
as benchmarks/counters/launch_budget.py does) and records, in NCCL-rules mode
(:mod:`megatron_startrail.nccl_rules`), that rank's whole program for one layer's forward
and backward: every post per communicator (NCCL's mapping of channels), every wait, every
collective. :func:`megatron_startrail.nccl_replay.replay` then runs all ranks' programs
together, and :func:`megatron_startrail.nccl_rules.verify` checks their audits (message
orders per pair, first operations per group): no hang, no mismatch, or the problems.

What a stand-in is and is not:

- The transport is NCCL's (:class:`~megatron_startrail.transport.NcclTransport`'s groups and
  channel mapping, no gloo-only twin of the CP group), its tensors on the CPU.
- Tensors are tiny CPU tensors, not meta ones: the packed-document agreement reads its
  collective's result on the host (its one host sync a micro-batch), which a meta tensor
  cannot; and meta tensors run PyTorch's Python decompositions, several times slower. The
  block kernel's math is stubbed (zeros of the right shapes): the program never depends on
  values. Message sizes are those of these shapes, not of a real run's.
- The fake group moves nothing: each rank's packed-document agreement sees only its own
  ``cu_seqlens`` (all ranks are given the same), so the cross-rank check itself is not
  exercised; its collective is recorded and replayed.
- Dynamic CP: Megatron's groups from ``parallel_state.initialize_model_parallel(
  hybrid_context_parallel=True)``, StarTrail's from ``initialize_dynamic_startrail``; one
  global batch scheduled by the scheduler it installs (Megatron's ``BalancedCPScheduler``
  with StarTrail's aligned fill); each rank runs its sub-samples phase by phase on the groups
  of their CP size, with Megatron's barrier over DP x CP between phases. A sub-sample's
  tokens are a few per rank whatever its length (its CP size and team size are its own).

    .venv/bin/python -m benchmarks.counters.scale_replay                       # the table (long)
    .venv/bin/python -m benchmarks.counters.scale_replay --world-sizes 32 64 --dynamic-sizes 64
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import random
import sys
import time
from unittest import mock

import torch
import torch.distributed as dist

import benchmarks
from megatron_startrail import nccl_rules, new_startrail_groups, startrail_attn
from megatron_startrail import transport as transport_module
from megatron_startrail.kernels.reference import ReferenceKernel
from megatron_startrail.nccl_replay import replay
from megatron_startrail.topology import valid_team_sizes

RESULTS = os.path.join(benchmarks.ROOT, "benchmarks/results/scale_replay.md")


@dataclasses.dataclass(frozen=True)
class Config:
    """One static-CP configuration: ``world`` ranks, one CP group of all of them."""

    world: int
    team: int
    ulysses: int = 1
    rotation: str = "auto"
    regather: bool = False
    window: str | None = None  # "halo": inside a chunk (halo exchange); "schedule": several chunks
    docs: str | None = None  # packed documents, "sample" or "document" layout
    local_tokens: int = 8  # per rank: two chunks of 4

    @property
    def name(self) -> str:
        parts = [f"P{self.world} C{self.team}"] + [f"U{self.ulysses}"] * (self.ulysses > 1)
        parts += [f"rotation {self.rotation}"] * (self.rotation != "auto") + ["regather"] * self.regather
        parts += [f"window ({self.window})"] * bool(self.window) + [f"packed ({self.docs})"] * bool(self.docs)
        return ", ".join(parts)


@dataclasses.dataclass
class Recording:
    """Every rank's program and audits, and the communicators each rank holds."""

    programs: dict[int, list] = dataclasses.field(default_factory=dict)
    audits: list[list[dict]] = dataclasses.field(default_factory=list)
    comms: dict[int, int] = dataclasses.field(default_factory=dict)  # rank -> StarTrail's communicators

    def events(self) -> int:
        return sum(len(p) for p in self.programs.values())


class _StandInNccl(transport_module.NcclTransport):
    """NCCL's groups and channel mapping, on the CPU: a wait is the fake work's (instant)."""

    def device(self):
        return torch.device("cpu")

    def wait(self, works, timeline=None, label=""):
        for w in works:
            w.wait()


def _attend_stub(self, q, k, v, *, causal, mask, scale):
    # The program never depends on values: zeros of the kernel's output shapes.
    out = q.new_zeros(*q.shape[:3], v.shape[-1])
    return out, torch.zeros(q.shape[:3], dtype=torch.float32)


def _attend_backward_stub(self, dout, q, k, v, out, lse, *, causal, mask, scale):
    return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


class _Created:
    """Counts the process groups that hold this rank, by who made them (``phase``)."""

    def __init__(self) -> None:
        self.phase, self.count = "startrail", {}

    def wrap(self, new_group):
        def counted(ranks=None, *args, **kwargs):
            pg = new_group(ranks, *args, **kwargs)
            if pg is not None and pg != dist.GroupMember.NON_GROUP_MEMBER and len(ranks or ()) > 1:
                self.count[self.phase] = self.count.get(self.phase, 0) + 1
            return pg
        return counted


@contextlib.contextmanager
def stand_in(rank: int, world: int):
    """This process as rank ``rank`` of ``world`` on the fake group, in NCCL-rules mode with
    NCCL's transport; yields a :class:`_Created` counting the groups made meanwhile."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: PLC0415 - test utility

    if dist.is_initialized():
        dist.destroy_process_group()
    created = _Created()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: a thread pool only contends with the other cores' work
    with contextlib.ExitStack() as stack:
        stack.callback(torch.set_num_threads, threads)
        stack.enter_context(mock.patch.dict(os.environ, {nccl_rules.ENV: "1"}))
        stack.enter_context(mock.patch.dict(transport_module.TRANSPORTS, {"nccl": _StandInNccl}))
        # Every module that asks which backend carries the attention hears "nccl" (the fake
        # group would answer gloo on a CPU): groups, channels and options as on GPUs.
        for module in [m for name, m in list(sys.modules.items()) if name.startswith("megatron_startrail")]:
            if getattr(module, "group_backend", None) is transport_module.group_backend:
                stack.enter_context(mock.patch.object(module, "group_backend", lambda *a, **k: "nccl"))
        stack.enter_context(mock.patch.object(ReferenceKernel, "_attend", _attend_stub))
        stack.enter_context(mock.patch.object(ReferenceKernel, "_attend_backward", _attend_backward_stub))
        stack.enter_context(mock.patch.object(dist, "new_group", created.wrap(dist.new_group)))
        nccl_rules.take_audits(), nccl_rules.take_program()
        dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            yield created
        finally:
            nccl_rules.take_audits(), nccl_rules.take_program()
            dist.destroy_process_group()


def _layer(groups, local_tokens: int, heads: int, **kwargs) -> None:
    """One layer's attention forward and backward on this rank (tiny CPU tensors)."""
    q, k, v = (torch.zeros(local_tokens, 1, heads, 4, requires_grad=True) for _ in range(3))
    out = startrail_attn(q, k, v, groups, **kwargs)
    torch.autograd.grad(out, (q, k, v), torch.zeros_like(out))


def _take(recording: Recording, rank: int, comms: int) -> None:
    recording.audits.append([a.export() for a in nccl_rules.take_audits()])
    recording.programs[rank] = nccl_rules.take_program()
    recording.comms[rank] = comms


def _attention_kwargs(cfg: Config) -> dict:
    """The attention's options of ``cfg``: window and packed documents (global cu_seqlens)."""
    from benchmarks.counters.launch_budget import lognormal_documents  # noqa: PLC0415

    kwargs = {"causal": True}
    chunk = cfg.local_tokens // 2  # tokens / (2 CP): every rank holds two chunks
    if cfg.window == "halo":
        kwargs["window_size"] = (chunk // 2, 0)
    elif cfg.window == "schedule":
        kwargs["window_size"] = (3 * chunk, 0)
    if cfg.docs:
        cu, cu_padded = lognormal_documents(cfg.local_tokens * cfg.world, 8, cfg.world, cfg.docs == "document")
        kwargs.update(cu_seqlens=cu, cu_seqlens_padded=cu_padded)
    return kwargs


def record_static(cfg: Config) -> Recording:
    """Every rank's program for one layer of ``cfg``, on StarTrail groups built the way the
    Megatron integration builds them: Megatron's CP group made first and handed over."""
    recording = Recording()
    for rank in range(cfg.world):
        with stand_in(rank, cfg.world) as created:
            created.phase = "megatron"
            cp_group = dist.new_group(list(range(cfg.world)))  # Megatron's CP group (reused)
            created.phase = "startrail"
            groups = new_startrail_groups(team_size=cfg.team, ulysses_size=cfg.ulysses,
                                          backward_rotation=cfg.rotation, regather_in_backward=cfg.regather,
                                          kernel="reference", cp_group=cp_group)
            _layer(groups, cfg.local_tokens, 4, **_attention_kwargs(cfg))
            _take(recording, rank, created.count.get("startrail", 0))
    return recording


def problems_of(recording: Recording) -> list[str]:
    """The replay's verdict: audits' rules 1-2 and the whole programs under NCCL's rules."""
    return nccl_rules.verify(recording.audits) + replay(recording.programs)


def plant_skipped_init_send(recording: Recording, rank: int) -> int:
    """The planted bug: ``rank`` leaves one piece out of its first initial send (its recorded
    post loses one send). Returns the peer that then waits for it."""
    program = recording.programs[rank]
    for i, event in enumerate(program):
        if event[0] == "post" and event[3] == "p2p":
            sends = [d for d in event[4] if d[1] == "send" and d[2] == "init_send"]
            if sends:
                program[i] = event[:4] + ([d for d in event[4] if d is not sends[0]],)
                return sends[0][0]
    raise ValueError(f"rank {rank} posted no initial send")


def static_configs(worlds) -> list[Config]:
    """Every C with C*C dividing P/U for U = 1, 2, 4; at each P the variants (rotations,
    regathering, windows, packed documents) on its largest team of U = 1."""
    configs = []
    for world in worlds:
        for ulysses in (1, 2, 4):
            configs += [Config(world, c, ulysses) for c in (1, 2, 4, 8) if c in valid_team_sizes(world // ulysses)]
        team = max(c for c in (1, 2, 4, 8) if c in valid_team_sizes(world))
        configs += [Config(world, team, rotation="q"), Config(world, team, rotation="kv"),
                    Config(world, team, regather=True), Config(world, team, window="halo"),
                    Config(world, team, window="schedule"),
                    Config(world, team, docs="sample", local_tokens=32),
                    Config(world, team, docs="document", local_tokens=32)]
    return configs


def _megatron():
    """megatron.core importable on this CPU stack (import shims), and its parallel_state."""
    from megatron_startrail.megatron import cpu_patches  # noqa: PLC0415

    cpu_patches.install_import_shims()
    from megatron.core import parallel_state  # noqa: PLC0415

    return parallel_state


def simulate_global_batch(world: int, seed: int, max_seqlen: int = 64) -> list[list[list[int]]]:
    """One global batch of hybrid CP over ``world`` DP x CP ranks: log-uniform documents of
    16 tokens to ``world * max_seqlen``, about twice ``world * max_seqlen`` in all, scheduled
    by StarTrail's aligned scheduler (Megatron's own where that is not there yet; then seeds
    whose placement is not aligned are skipped). ``[phase][rank]``: the sub-samples run."""
    import math  # noqa: PLC0415

    _megatron()
    from megatron_startrail.megatron.dynamic_cp import schedule_sizes  # noqa: PLC0415

    try:
        from megatron_startrail.megatron.aligned_schedule import AlignedCPScheduler as Scheduler  # noqa: PLC0415
    except ImportError:
        from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler as Scheduler  # noqa

    for attempt in range(50):
        rng = random.Random(seed + attempt)
        lengths: list[int] = []
        while sum(lengths) < 2 * world * max_seqlen:
            lengths.append(int(math.exp(rng.uniform(math.log(16), math.log(world * max_seqlen)))))
        scheduler = Scheduler(max_seqlen, type("DPxCP", (), {"size": lambda self: world})())
        _, sample_id_groups = scheduler.get_groups_and_subsamples(list(enumerate(lengths)), None)
        try:
            schedule_sizes(sample_id_groups)  # every placement one of Megatron's aligned groups
        except RuntimeError:
            continue
        return sample_id_groups
    raise RuntimeError(f"no aligned schedule at DP x CP = {world} in 50 seeds from {seed}")


def record_dynamic(world: int, team: int, schedule: list[list[list[int]]], reuse: bool = True) -> Recording:
    """Every rank's program for one layer over the global batch ``schedule``: Megatron's
    groups and StarTrail's for every CP size (the integration's entry points), each rank's
    sub-samples phase by phase, Megatron's barrier over DP x CP between phases."""
    parallel_state = _megatron()
    from megatron_startrail.config import StarTrailConfig  # noqa: PLC0415
    from megatron_startrail.megatron.dynamic_cp import initialize_dynamic_startrail  # noqa: PLC0415

    recording = Recording()
    holders = [{s: sum(s in ids for ids in per_rank) for ids in per_rank for s in ids} for per_rank in schedule]
    for rank in range(world):
        with stand_in(rank, world) as created:
            created.phase = "megatron"
            parallel_state.initialize_model_parallel(hybrid_context_parallel=True, create_gloo_process_groups=False)
            dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
            nccl_rules.name_group(dp_cp, "megatron_dp_cp")
            created.phase = "startrail"
            try:
                dynamic = initialize_dynamic_startrail(StarTrailConfig(team_size=team, kernel="reference"),
                                                       order="tp-cp-ep-dp-pp", reuse_megatron_groups=reuse)
                for phase, per_rank in enumerate(schedule):
                    for sample in per_rank[rank]:
                        _layer(dynamic.for_call(holders[phase][sample], None), 8, 4)
                    if phase + 1 < len(schedule):  # Megatron: a barrier before the CP sizes change
                        work = dist.barrier(group=dp_cp, async_op=True)
                        nccl_rules.record_collective(dp_cp, "hybrid_cp_barrier", work)
                        nccl_rules.record_wait(work)
                _take(recording, rank, created.count.get("startrail", 0))
            finally:
                parallel_state.destroy_model_parallel()
    return recording


def megatron_communicators(world: int, *, hybrid: bool) -> int:
    """Megatron's process groups of more than one rank holding rank 0 (NCCL communicators,
    no gloo groups): static CP over all ``world`` ranks, or hybrid CP (DP x CP = ``world``)."""
    parallel_state = _megatron()
    with stand_in(0, world) as created:
        created.phase = "megatron"
        try:
            parallel_state.initialize_model_parallel(context_parallel_size=1 if hybrid else world,
                                                     hybrid_context_parallel=hybrid, create_gloo_process_groups=False)
        finally:
            parallel_state.destroy_model_parallel()
    return created.count.get("megatron", 0)


def _row(name: str, world: int, recording: Recording, seconds: float, before: int | None,
         megatron: int) -> dict:
    problems = problems_of(recording)
    comms = sorted(set(recording.comms.values()))
    return {"configuration": name, "ranks": world, "events": recording.events(), "problems": problems,
            "comms": comms, "before": before, "megatron": megatron, "seconds": seconds}


def run_static(cfg: Config, megatron: int) -> dict:
    start = time.perf_counter()
    return _row(cfg.name, cfg.world, record_static(cfg), time.perf_counter() - start, None, megatron)


def run_dynamic(world: int, team: int, seed: int, megatron: int) -> dict:
    """Hybrid CP at DP x CP = ``world``: recorded with the reuse of Megatron's groups
    (Note [communicators]) and, for the count before it, without."""
    schedule = simulate_global_batch(world, seed)
    start = time.perf_counter()
    recording = record_dynamic(world, team, schedule)
    seconds = time.perf_counter() - start
    before = max(record_dynamic(world, team, schedule[:1], reuse=False).comms.values())
    sizes = {}
    for per_rank in schedule:
        for s in {s for ids in per_rank for s in ids}:
            k = sum(s in ids for ids in per_rank)
            sizes[k] = sizes.get(k, 0) + 1
    name = (f"dynamic CP, DP x CP {world}, C <= {team}, {len(schedule)} phases, sub-samples per CP size "
            + " ".join(f"{k}:{n}" for k, n in sorted(sizes.items())))
    return _row(name, world, recording, seconds, before, megatron)


def planted_bug(world: int = 128, team: int = 8, rank: int = 5,
                recording: Recording | None = None) -> tuple[int, list[str]]:
    """The planted bug at ``world``: ``rank`` skips one piece of its initial send. Planted in a
    copy of ``recording`` (a clean recording of ``Config(world, team)``, left as it is) when one
    is given, else in a fresh recording."""
    if recording is None:
        recording = record_static(Config(world, team))
    else:
        recording = dataclasses.replace(recording, programs={r: list(p) for r, p in recording.programs.items()})
    peer = plant_skipped_init_send(recording, rank)
    return peer, problems_of(recording)


def table(rows: list[dict]) -> list[str]:
    out = ["| configuration | ranks | events replayed | hang-free, no mismatch | StarTrail communicators per "
           "rank (before reuse) | Megatron's per rank | seconds |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        comms = "-".join(map(str, (r["comms"][0], r["comms"][-1]) if len(r["comms"]) > 1 else r["comms"]))
        if r["before"] is not None:
            comms += f" ({r['before']})"
        verdict = "yes" if not r["problems"] else f"NO: {r['problems'][0][:200]}"
        out.append(f"| {r['configuration']} | {r['ranks']} | {r['events']} | {verdict} | {comms} | "
                   f"{r['megatron']} | {r['seconds']:.0f} |")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[32, 64, 128, 256])
    parser.add_argument("--dynamic-sizes", type=int, nargs="*", default=[64, 256])
    parser.add_argument("--dynamic-team-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--only", help="run the static configurations whose name contains this")
    parser.add_argument("--out", default=RESULTS, help="the markdown table (empty: not written)")
    args = parser.parse_args(argv)
    rows = []
    for world in args.world_sizes:
        megatron = megatron_communicators(world, hybrid=False)
        for cfg in static_configs([world]):
            if args.only is None or args.only in cfg.name:
                rows.append(run_static(cfg, megatron))
                print("\n".join(table(rows[-1:])[2:]), flush=True)
    for world in args.dynamic_sizes:
        rows.append(run_dynamic(world, args.dynamic_team_size, args.seed, megatron_communicators(world, hybrid=True)))
        print("\n".join(table(rows[-1:])[2:]), flush=True)
    peer, problems = planted_bug()
    lines = table(rows) + ["", "Planted bug (P = 128, C = 8: rank 5 skips one piece of its first initial send), "
                           f"the replay's first problems (rank {peer} waits):", ""]
    lines += [f"    {p.splitlines()[0][:400]}" for p in problems[:2]]
    print("\n".join(lines[-4:]))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(_HEADER + "\n".join(lines) + "\n")


_HEADER = """# Every rank's program at scale, replayed under NCCL's rules

`benchmarks/counters/scale_replay.py` (issue 38, item 3): one process stands in for every rank in
turn (torch's fake process group), records its whole program for one layer's forward and
backward in NCCL-rules mode, and `nccl_replay.replay` runs all ranks' programs together
(`nccl_rules.verify` checks the audits). Static CP: one CP group of P ranks (Megatron's,
handed to StarTrail). Dynamic CP: Megatron's hybrid groups and StarTrail's for every CP
size, one simulated global batch (aligned schedule), Megatron's barrier between phases.
Communicators per rank: process groups of more than one rank holding the rank (min-max over
ranks); for dynamic CP, in brackets, before StarTrail reused Megatron's groups for its
teams (Note [communicators]). Megatron's: its groups holding rank 0 (no gloo groups) for
TP = PP = 1 and CP = P (static) or hybrid CP with DP = P.

"""


if __name__ == "__main__":
    main()
