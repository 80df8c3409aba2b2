"""The attention's rehearsal matrix on fake CUDA (child side: ``python -m tests.fake_cuda.matrix --json OUT``,
started by :func:`tests.fake_cuda.run.run_fake_cuda`).

Each case is one rank (rank 1) of a CP group of ``P`` GPUs: GQA 32/8 heads x 128, bf16, causal,
128K tokens, two micro-batches of two layers each (the same ``cu_seqlens`` tensors for both
layers of a micro-batch, new ones for the next, as Megatron hands them), forward and backward.
What a case records (the test asserts on it):

- ``transports``: the transport classes the attention communicated through;
- ``kernel_ops``: the attention kernels' ops that ran (or the flash-attn double's calls);
- ``mixed``: ops on tensors of more than one device;
- ``sync_sites``: the package frames of host syncs; ``syncs_after_first_forward``: the syncs after
  the first layer's forward of each micro-batch (the packed-document agreement is once per micro-batch);
- ``h2d``: host-to-device copies of the second micro-batch (the first learns its requests), with
  non-blocking and pinned; ``d2h``: device-to-host copies from the package;
- ``precision``: merges, lse and sums that are not float32 although their inputs are bf16;
- ``cuda_queries``: the package frames that asked torch.cuda what a CPU build cannot answer;
- ``contract_checks``: the attention ops whose contracts (:mod:`.aten_doubles`) the case's calls
  met (a violation stops the child).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

from megatron_startrail import comm, new_startrail_groups, startrail_attn
from megatron_startrail.transport import NcclTransport
from tests.fake_cuda import flash_attn_double
from tests.fake_cuda.rank import fake_cuda_rank, is_package_frame, leave

aten = torch.ops.aten
TOKENS, HEADS, KV_HEADS, DIM = 131072, 32, 8, 128
RANK = 1
KERNEL_OPS = {
    "torch_cuda_flash": {"aten._flash_attention_forward.default", "aten._flash_attention_backward.default"},
    "torch_cuda_efficient": {"aten._scaled_dot_product_efficient_attention.default",
                             "aten._scaled_dot_product_efficient_attention_backward.default"},
    "flash_attn": {"flash_attn.forward", "flash_attn.backward"},
}
ATTENTION_OPS = set().union(*KERNEL_OPS.values())


TEAMS = [(8, 1), (8, 2), (16, 1), (16, 2), (16, 4)]  # (P, C)
LAYOUTS, ROTATIONS = ("dense", "sample", "document"), ("q", "kv")
KERNELS = ("torch_cuda_flash", "torch_cuda_efficient", "flash_attn")


def cases(quick: bool = False):
    """(P, C, layout, rotation, regather, kernel): every value of every setting, and every pair of
    settings together at least once (``tests/test_fake_cuda_rehearsal.py`` asserts both), not the
    full product. What a case records (its syncs, copies, devices, precisions, transport, kernel
    ops) follows the code paths that one setting or two together choose: the layout picks the
    documents' metadata, (P, C) the teams and rings, the rotation and regathering the backward.
    With torch's flash kernel each (P, C) runs each layout once (15 cases), rotation alternating
    case by case and regathering every other pair; the memory-efficient kernel and flash-attn run
    each layout with each rotation (6 cases each), half on P8 C2 and half on P16 C4, except the
    memory-efficient kernel's document layout, on P8 C2 only: that adapter launches once per
    document piece of a call (its op takes no ``cu_seqlens``), ~27,000 ops for a P16 C4 case.
    (The full product, 82 cases, took 288 CPU-seconds of a 2-core run; these 27 take ~115: issue
    56, the suite's time.)"""
    out = [(p, c, layout, ROTATIONS[i % 2], bool(i // 2 % 2), KERNELS[0])
           for i, ((p, c), layout) in enumerate(itertools.product(TEAMS, LAYOUTS))]
    for kernel in KERNELS[1:]:
        for i, (layout, rotation) in enumerate(itertools.product(LAYOUTS, ROTATIONS)):
            on_p8 = (i + i // 2) % 2 == 0 or (kernel, layout) == ("torch_cuda_efficient", "document")
            out.append((*((8, 2) if on_p8 else (16, 4)), layout, rotation, False, kernel))
    return out[:: 7] if quick else out


def packed_boundaries(layout: str, p: int):
    """``cu_seqlens`` (and ``cu_seqlens_padded`` for the document layout) of 5 documents in 128K tokens."""
    lengths = [40001, 9000, 30000, 20000]
    if layout == "sample":
        lengths.append(TOKENS - sum(lengths))
        return list(itertools.accumulate([0] + lengths)), None
    unit = 2 * p  # each document's padded span is zigzagged on its own: a multiple of 2P
    padded = [-(-n // unit) * unit for n in lengths]
    padded.append(TOKENS - sum(padded))
    lengths.append(padded[-1] - unit)
    return list(itertools.accumulate([0] + lengths)), list(itertools.accumulate([0] + padded))


def run_case(p, c, layout, rotation, regather, kernel, rules) -> dict:
    groups = new_startrail_groups(team_size=c, backward_rotation=rotation, regather_in_backward=regather,
                                  kernel=kernel, eager_init=False)
    n = TOKENS // p
    used = []
    # Everything but "h2d" over both micro-batches (the dispatch records are cleared for each).
    record = {"syncs_after_first_forward": [], "h2d": [], "d2h": [], "sync_sites": set(), "mixed": [],
              "precision": [], "cuda_queries": []}
    for micro_batch in range(2):
        cu = padded = None
        if layout != "dense":
            bounds, padded_bounds = packed_boundaries(layout, p)
            cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")  # Megatron's: on the device
            padded = None if padded_bounds is None else torch.tensor(padded_bounds, dtype=torch.int32, device="cuda")
        rules.clear()
        outs = []
        for layer in range(2):
            q = torch.randn(n, 1, HEADS, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k, v = (torch.randn(n, 1, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                    for _ in range(2))
            outs.append(startrail_attn(q, k, v, groups, causal=True, cu_seqlens=cu, cu_seqlens_padded=padded))
            if layer == 0:
                first = len(rules.syncs)
        torch.autograd.backward(outs, [torch.randn_like(o) for o in outs])
        record["syncs_after_first_forward"] += rules.syncs[first:]
        if micro_batch == 1:  # the package's copies, not the test's own (its cu_seqlens)
            record["h2d"] = [vars(c_) for c_ in rules.host_to_device() if is_package_frame(c_.where)]
        record["d2h"] += [vars(c_) for c_ in rules.device_to_host() if is_package_frame(c_.where)]
        used += [str(f) for f in rules.ops if str(f) in ATTENTION_OPS]
        record["sync_sites"] |= {where for _, where in rules.syncs}
        record["mixed"] += rules.mixed
        record["precision"] += [f"{r[0]} {r[3]} {r[1]}->{r[2]}" for r in rules.precision if not _fp32_where_due(r)]
        record["cuda_queries"] += [who for _, who in rules.cuda_queries if "/megatron_startrail/" in who]
    record["sync_sites"] = sorted(record["sync_sites"])
    return record, sorted(set(used))


def _fp32_where_due(record) -> bool:
    """Merges compute in float32; a kernel's lse is float32; a sum of bf16 values gives float32."""
    what, inputs, outputs, _ = record
    if what == "kernel":
        return len(outputs) > 1 and outputs[1] == torch.float32
    if what == "sum":
        return torch.bfloat16 not in inputs or outputs[0] == torch.float32
    return all(d == torch.float32 for d in inputs + outputs)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--quick", action="store_true", help="every 7th case")
    parser.add_argument("--shard", default="0/1", metavar="I/N",
                        help="cases I, I+N, I+2N, ... (N children run the matrix side by side)")
    args = parser.parse_args(argv)
    shard, shards = (int(x) for x in args.shard.split("/"))
    flash_attn_double.install()
    transports = []
    init = comm.Communicator.__init__

    def recording_init(self, stats, transport, *a, **k):
        transports.append(type(transport))
        init(self, stats, transport, *a, **k)

    comm.Communicator.__init__ = recording_init
    results = []
    todo = cases(args.quick)[shard::shards]
    for p in sorted({case[0] for case in todo}):
        with fake_cuda_rank(RANK, p) as (_, rules):
            for case in (c for c in todo if c[0] == p):
                transports.clear()
                calls_before = dict(flash_attn_double.calls)
                checks_before = dict(rules.contracts.checked)
                start = time.perf_counter()
                record, used = run_case(*case, rules)
                record["contract_checks"] = sorted(op for op, n in rules.contracts.checked.items()
                                                   if n > checks_before.get(op, 0))
                if flash_attn_double.calls != calls_before:
                    used += ["flash_attn.forward", "flash_attn.backward"]
                record.update(case=dict(zip(("P", "C", "layout", "rotation", "regather", "kernel"), case)),
                              kernel_ops=sorted(set(used)), seconds=round(time.perf_counter() - start, 2),
                              transports=sorted({"nccl" if issubclass(t, NcclTransport) else t.__name__
                                                 for t in transports}))
                results.append(record)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1, default=str)
    leave()


if __name__ == "__main__":
    main()
