"""The rehearsal's rules must be able to fail (child side: ``python -m tests.fake_cuda.selfcheck --json OUT``).

Does on fake CUDA each thing :class:`~tests.fake_cuda.rank.DeviceRules` is there to catch, and
writes what it recorded: a host read of a device value, a copy to the host, a blocking copy
from pageable memory, a merge in bf16, a bf16 sum, torch.cuda asked from a package frame
(simulated by a function compiled with a package file name), and a kernel run for real.
"""

from __future__ import annotations

import argparse
import json

import torch

from tests.fake_cuda.rank import fake_cuda_rank, leave

# A call from "a package file": code compiled with such a filename shows as the package's frame.
_PACKAGE_CALL = compile("def ask():\n    return torch.cuda.get_device_capability(0)\n",
                        "/x/megatron_startrail/fake_module.py", "exec")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    with fake_cuda_rank(0, 2) as (_, rules):
        x = torch.randn(64, 8, device="cuda", dtype=torch.bfloat16)
        n = torch.tensor([3, 4], device="cuda")  # a blocking copy from pageable host memory
        known = int(n.sum())  # a host read: a sync (its value is followed on the CPU)
        x.float().cpu()  # a copy to the host
        torch.sigmoid(x)  # a "merge" op in bf16
        x.sum(dim=0)  # a bf16 sum to bf16
        scope = {"torch": torch}
        exec(_PACKAGE_CALL, scope)
        scope["ask"]()
        record = dict(known=known, syncs=rules.syncs, copies=[vars(c) for c in rules.copies],
                      precision=[(r[0], [str(d) for d in r[1]], [str(d) for d in r[2]]) for r in rules.precision],
                      cuda_queries=rules.cuda_queries)
    with open(args.json, "w") as f:
        json.dump(record, f, indent=1, default=str)
    leave()


if __name__ == "__main__":
    main()
