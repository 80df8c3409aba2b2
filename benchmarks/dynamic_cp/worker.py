"""One rank of benchmarks/dynamic_cp/bench.py: examples/pretrain_gpt.py with timers around it.

    python -m benchmarks.dynamic_cp.worker SPEC.json      (RANK, WORLD_SIZE, ... from the cluster)

SPEC: ``{"argv": [...the example's flags...], "output": DIR}``. Writes ``DIR/rank<r>.json``:
the wall time of every ``train_step``, the time this rank waited in the hybrid schedule's
barriers during each (``torch.distributed.barrier``: the imbalance between ranks), the
sub-samples it ran (CP size, padded length; hybrid CP only), the bytes its node's
inter-node interfaces sent during the timed steps (local rank 0 of a node; from
``/sys/class/net``, ``INTER_NODE_LINKS``), and on the last rank Megatron's log.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import sys
import time

from benchmarks import ROOT
from benchmarks.testbed.netns_cluster import inter_node_links, node_tx_bytes  # stdlib only: before the shims is fine


def main(spec_path: str) -> None:
    spec = json.load(open(spec_path))
    rank = int(os.environ["RANK"])
    os.environ.setdefault("LOCAL_RANK", str(rank % int(os.environ["RANKS_PER_NODE"])))
    os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ["RANKS_PER_NODE"])
    module_spec = importlib.util.spec_from_file_location("pretrain_gpt", os.path.join(ROOT, "examples", "pretrain_gpt.py"))
    example = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(example)

    import torch.distributed as dist  # noqa: PLC0415 - after the example's CPU shims
    from megatron.training import training  # noqa: PLC0415

    steps, sub_samples, waits = [], [], [0.0]
    barrier = dist.barrier

    def timed_barrier(*args, **kwargs):
        start = time.perf_counter()
        try:
            return barrier(*args, **kwargs)
        finally:
            waits[0] += time.perf_counter() - start

    dist.barrier = timed_barrier
    train_step = training.train_step
    measure_node = rank % int(os.environ["RANKS_PER_NODE"]) == 0
    links = inter_node_links()
    tx = {}

    def timed_train_step(*args, **kwargs):
        if measure_node and "start" not in tx and len(steps) == spec.get("warmup", 1):
            tx["start"] = node_tx_bytes(links)
        waits[0] = 0.0
        start = time.perf_counter()
        out = train_step(*args, **kwargs)
        steps.append({"seconds": time.perf_counter() - start, "barrier_wait_s": waits[0]})
        if measure_node and "start" in tx:
            tx["end"] = node_tx_bytes(links)
        return out

    training.train_step = timed_train_step
    get_batch = example.get_dynamic_cp_batch

    def recording(data_iterator):
        batch, params = get_batch(data_iterator)
        sub_samples.append((len(steps), params.local_cp_size, int(params.max_seqlen_q)))
        return batch, params

    example.get_dynamic_cp_batch = recording
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        example.main(spec["argv"])
    out = {"rank": rank, "steps": steps, "sub_samples": sub_samples,
           "internode_tx_bytes": tx["end"] - tx["start"] if "end" in tx else None}
    if rank == int(os.environ["WORLD_SIZE"]) - 1 or rank == 0:
        out["log"] = log.getvalue()[-20000:]
    with open(os.path.join(spec["output"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("spec", help="the JSON file dynamic_cp/bench.py writes for this configuration")
    main(parser.parse_args().spec)
