"""The GPU command README.md shows says what it launches, and the example accepts it.

- The sentence before it ("2 nodes x 8 GPUs, 16 ranks") names torchrun's --nnodes and
  --nproc-per-node, and their product.
- The ranks torchrun starts are exactly the TP x PP x CP grid the command asks for (one
  data-parallel replica: any other rank count is a different run).
- Megatron's parse_args and validate_args, validate_startrail_args and the example's own
  checks accept it on rank 0 of that many ranks (with torchrun's LOCAL_WORLD_SIZE), and the
  planner's team size satisfies the README's rule (C*C divides CP / U) and is a StarTrail
  team (C > 1), not ring attention.
"""

from __future__ import annotations

import os
import re
import sys

import pytest

from tests.megatron.example import ROOT, pretrain_gpt
from tests.megatron.utils import cpu_patches
from tests.multiproc import run_ranks

from megatron.training.arguments import core_transformer_config_from_args  # noqa: E402 - after the CPU shims


def readme_text() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read()


def gpu_command(text: str) -> tuple[str, list[str], list[str]]:
    """(the sentence that introduces the "On GPUs" command, torchrun's arguments before
    examples/pretrain_gpt.py, the arguments after it)."""
    block = re.search(r"(On GPUs.*?)```bash\n(.*?)```", text, re.S)
    assert block, "README.md has no GPU command under 'On GPUs'"
    words = block.group(2).replace("\\\n", " ").split()
    assert words[0] == "torchrun", words
    script = words.index("examples/pretrain_gpt.py")
    return " ".join(block.group(1).split()), words[1:script], words[script + 1:]


def flag(words: list[str], name: str, default=None):
    return words[words.index(name) + 1] if name in words else default


def launched_ranks(sentence: str, torchrun: list[str]) -> int:
    """The rank count torchrun starts, after checking that the sentence says the same."""
    nnodes, nproc = int(flag(torchrun, "--nnodes", 1)), int(flag(torchrun, "--nproc-per-node", 1))
    said = re.search(r"(\d+) nodes? x (\d+) GPUs?, (\d+) ranks", sentence)
    assert said, f"README's GPU command does not say 'N nodes x G GPUs, R ranks': {sentence!r}"
    assert (int(said[1]), int(said[2])) == (nnodes, nproc), (sentence, torchrun)
    assert int(said[3]) == nnodes * nproc, f"{sentence!r}: {nnodes} x {nproc} = {nnodes * nproc} ranks"
    return nnodes * nproc


def test_the_text_checks_can_fail():
    """What README once said ("16 ranks per node" over 2 nodes x 8) and a miscounted line are refused."""
    torchrun = ["--nproc-per-node", "8", "--nnodes", "2"]
    with pytest.raises(AssertionError):
        launched_ranks("On GPUs (bf16, Transformer Engine layer spec, NCCL), 16 ranks per node:", torchrun)
    with pytest.raises(AssertionError):
        launched_ranks("On GPUs, 2 nodes x 8 GPUs, 8 ranks:", torchrun)
    with pytest.raises(AssertionError):
        launched_ranks("On GPUs, 1 node x 8 GPUs, 8 ranks:", torchrun)
    assert launched_ranks("On GPUs, 2 nodes x 8 GPUs, 16 ranks:", torchrun) == 16


def parse_worker(rank, world_size, argv, ranks, per_node):
    # Rank 0 of what torchrun starts (LOCAL_WORLD_SIZE: the planner's ranks per node).
    os.environ.update(WORLD_SIZE=str(ranks), RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE=str(per_node))
    cpu_patches.apply()  # Megatron's validation asks for the device's architecture
    sys.argv = ["pretrain_gpt.py", *argv]
    args = pretrain_gpt.parse_arguments()  # validate_args, validate_startrail_args, the example's checks
    return dict(algo=args.context_parallel_algo, world=args.world_size, tp=args.tensor_model_parallel_size,
                pp=args.pipeline_model_parallel_size, cp=args.context_parallel_size,
                dp=args.data_parallel_size, team=args.startrail_team_size, ulysses=args.ulysses_degree_in_cp,
                bf16=args.bf16, seq=args.seq_length,
                kv_heads=core_transformer_config_from_args(args).num_query_groups)


def test_the_readme_gpu_command_launches_the_grid_it_asks_for_and_is_accepted():
    sentence, torchrun, argv = gpu_command(readme_text())
    ranks = launched_ranks(sentence, torchrun)
    per_node = int(flag(torchrun, "--nproc-per-node", 1))
    (got,) = run_ranks(parse_worker, 1, args=(argv, ranks, per_node), timeout=120)
    # The command's own numbers, read from its words (not from the parser) ...
    asked = {name: int(flag(argv, f"--{name}-size", 1)) for name in
             ("tensor-model-parallel", "pipeline-model-parallel", "context-parallel")}
    assert (got["tp"], got["pp"], got["cp"]) == tuple(asked.values()), (got, asked)
    # ... fill exactly the ranks torchrun starts: TP x PP x CP, one data-parallel replica.
    assert got["tp"] * got["pp"] * got["cp"] == ranks == got["world"], (got, ranks)
    assert got["dp"] == 1, got
    assert got["algo"] == "startrail" and got["bf16"] and got["seq"] == int(flag(argv, "--seq-length"))
    # --startrail-team-size auto resolved to a team size C with C*C dividing CP / U.
    team, u = got["team"], got["ulysses"]
    assert isinstance(team, int) and (got["cp"] // u) % (team * team) == 0, got
    assert team > 1, f"the planner runs ring attention (C = 1) for README's 2-node command: {got}"
    # The model it builds has the K/V heads the command names (Megatron drops --num-query-groups
    # without --group-query-attention: the README once trained MHA while saying GQA).
    assert got["kv_heads"] == int(flag(argv, "--num-query-groups", 0)), got
