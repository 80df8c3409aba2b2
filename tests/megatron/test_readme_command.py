"""The GPU command README.md shows is accepted by the example's parser and validation
(Megatron's parse_args with the StarTrail flags, validate_args, validate_startrail_args,
the example's own checks), run as rank 0 of the 16 ranks it asks for."""

from __future__ import annotations

import os
import re
import sys

from tests.megatron.example import ROOT, pretrain_gpt
from tests.megatron.utils import cpu_patches
from tests.multiproc import run_ranks


def readme_gpu_command() -> list[str]:
    """The arguments after examples/pretrain_gpt.py in the README's "On GPUs" command."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    block = re.search(r"On GPUs.*?```bash\n(.*?)```", text, re.S)
    assert block, "README.md has no GPU command under 'On GPUs'"
    words = block.group(1).replace("\\\n", " ").split()
    return words[words.index("examples/pretrain_gpt.py") + 1:]


def parse_worker(rank, world_size, argv):
    os.environ.update(WORLD_SIZE="16", RANK="0", LOCAL_RANK="0")  # the command's 2 x 8 ranks
    cpu_patches.apply()  # Megatron's validation asks for the device's architecture
    sys.argv = ["pretrain_gpt.py", *argv]
    args = pretrain_gpt.parse_arguments()
    return args.context_parallel_algo, args.context_parallel_size, args.bf16, args.seq_length


def test_the_readme_gpu_command_is_accepted_by_the_example():
    argv = readme_gpu_command()
    assert "--bf16" in argv and "--context-parallel-algo" in argv
    (result,) = run_ranks(parse_worker, 1, args=(argv,), timeout=120)
    assert result == ("startrail", 16, True, 131072)
