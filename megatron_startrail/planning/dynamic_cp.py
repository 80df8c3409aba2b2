"""Pricing a micro-batch of Megatron's hybrid (dynamic) context parallelism with StarTrail.

Under ``--hybrid-context-parallel`` every sub-sample (one document of a packed sample) runs
on a CP group of ``k`` ranks, ``k`` the power of two that holds it at
``--max-seqlen-per-dp-cp-rank`` tokens per rank (megatron-core 0.19.2,
``BalancedCPScheduler.gpus_needed``), with the team size of that size
(:func:`~megatron_startrail.topology.team_size_for`). :func:`price_dynamic_batch` prices
every sub-sample with :func:`~megatron_startrail.planning.planner.predict` on its own
group, and the same documents under static CP with the same flags: packed samples of
``--seq-length`` tokens, each on one fixed CP group (the whole sample's K, V circulate,
whatever its documents). Groups are Megatron's aligned slices of consecutive ranks, so a
group of at most a node's GPUs sends nothing across nodes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..topology import team_size_for
from .cluster import ClusterSpec
from .planner import Workload, predict


def cp_size_for(length: int, max_seqlen_per_rank: int, dp_cp: int) -> int:
    """The CP size Megatron's scheduler gives a sub-sample of ``length`` tokens."""
    k = max(1, 2 ** math.ceil(math.log2(length / max_seqlen_per_rank)))
    if k > dp_cp:
        raise ValueError(
            f"a {length}-token document needs {k} ranks at --max-seqlen-per-dp-cp-rank {max_seqlen_per_rank}, "
            f"more than the {dp_cp} data x context parallel ranks"
        )
    return k


@dataclass(frozen=True)
class DynamicPrice:
    """One attention layer (forward + backward) over a global batch, both ways."""

    sub_samples: dict[int, int]  # CP size -> sub-samples run at it
    team_sizes: dict[int, int]  # CP size -> its team size
    internode_bytes: float  # summed over sub-samples, each its group's busiest node's
    rank_seconds: float  # summed over sub-samples: predicted time x ranks of its group
    static_internode_bytes: float  # the same documents, packed, on the fixed CP group
    static_rank_seconds: float


def price_dynamic_batch(cluster: ClusterSpec, work: Workload, lengths: list[int], *, dp_cp: int,
                        max_seqlen_per_rank: int, team_size: int, static_cp: int, static_team_size: int,
                        samples: int) -> DynamicPrice:
    """``lengths``: the global batch's documents (sub-samples); ``samples``: the packed
    samples of ``work.seq_length`` tokens they come in (static CP's unit of work)."""
    sub_samples, team_sizes, internode, rank_s = {}, {}, 0.0, 0.0
    for length in lengths:
        k = cp_size_for(length, max_seqlen_per_rank, dp_cp)
        c = team_size_for(k, team_size)
        padded = -(-length // (2 * k)) * 2 * k  # the example pads a sub-sample to a multiple of 2k
        pred = predict(cluster, dataclasses.replace(work, seq_length=padded), k, c)
        sub_samples[k] = sub_samples.get(k, 0) + 1
        team_sizes[k] = c
        internode += pred.internode_bytes
        rank_s += pred.time_s * k
    static = predict(cluster, work, static_cp, static_team_size)
    return DynamicPrice(dict(sorted(sub_samples.items())), dict(sorted(team_sizes.items())), internode, rank_s,
                        samples * static.internode_bytes, samples * static.time_s * static_cp)


def main(argv: list[str] | None = None) -> None:
    """``python -m megatron_startrail.planning.dynamic_cp``: one global batch's documents
    priced under hybrid CP with StarTrail, with ring attention, and under static CP."""
    import argparse  # noqa: PLC0415

    from .cluster import DEFAULT_CLUSTER, PRESETS, preset  # noqa: PLC0415

    p = argparse.ArgumentParser(prog="python -m megatron_startrail.planning.dynamic_cp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cluster", choices=PRESETS, default=DEFAULT_CLUSTER)
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, default=None, help="data x context parallel ranks per node")
    p.add_argument("--seq-length", type=int, required=True, help="packed sample length (static CP's unit)")
    p.add_argument("--max-seqlen-per-dp-cp-rank", type=int, required=True)
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype-bytes", type=int, default=2)
    p.add_argument("--startrail-team-size", type=int, default=2, metavar="C")
    p.add_argument("--context-parallel-size", type=int, required=True, help="static CP, for the comparison")
    p.add_argument("--document-lengths", type=int, nargs="+", required=True, help="the global batch's documents")
    args = p.parse_args(argv)
    cluster = preset(args.cluster, args.nodes, **({"gpus_per_node": args.gpus_per_node} if args.gpus_per_node else {}))
    dp_cp = args.nodes * cluster.gpus_per_node
    work = Workload(args.seq_length, args.heads, args.kv_heads or args.heads, args.head_dim,
                    dtype_bytes=args.dtype_bytes)
    samples = -(-sum(args.document_lengths) // args.seq_length)
    static_c = team_size_for(args.context_parallel_size, args.startrail_team_size)
    print("per attention layer, forward + backward, over the documents given")
    print(f"{'configuration':40} {'inter-node MiB':>15} {'GPU-seconds':>12}  sub-samples per CP size (team size)")
    for name, c in (("hybrid CP, ring attention (C = 1)", 1), (f"hybrid CP, StarTrail (C <= {args.startrail_team_size})",
                                                               args.startrail_team_size)):
        price = price_dynamic_batch(cluster, work, args.document_lengths, dp_cp=dp_cp,
                                    max_seqlen_per_rank=args.max_seqlen_per_dp_cp_rank, team_size=c,
                                    static_cp=args.context_parallel_size, static_team_size=static_c, samples=samples)
        sizes = ", ".join(f"{k}: {n} ({price.team_sizes[k]})" for k, n in price.sub_samples.items())
        print(f"{name:40} {price.internode_bytes / 2**20:15.1f} {price.rank_seconds:12.4f}  {sizes}")
    print(f"{f'static CP {args.context_parallel_size}, StarTrail C = {static_c}':40} "
          f"{price.static_internode_bytes / 2**20:15.1f} {price.static_rank_seconds:12.4f}  "
          f"{samples} packed samples of {args.seq_length}")


if __name__ == "__main__":
    main()
