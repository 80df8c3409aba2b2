"""The model-level differential fuzzer (benchmarks/accuracy/model_fuzz.py) in the suite: a fixed slice of
draws that covers the call protocols and the features whose state outlives a call, plus draws
from a seed derived from the commit, printed so that a failure reproduces
(``python -m benchmarks.accuracy.model_fuzz --seed SEED --first I --draws 1``). No draw may differ from
CP = 1 or fail; a refusal by name and a configuration the CP = 1 reference cannot run are fine.
"""

from __future__ import annotations

import hashlib
import os
import subprocess

import pytest

from benchmarks.accuracy import model_fuzz

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAIN_SEED = 20261127  # the seed of the committed table, benchmarks/results/model_fuzz.md
# Draws of MAIN_SEED chosen for what they cover (their rows in the committed table): 4 SP, MLA, selective
# layernorm+mla_up_proj, MTP, Ulysses, save and resume; 11 selective mlp with biases (refused
# by name); 20 MoE at TP2 with SP and recomputation, a halo
# window, a repeated MTP layer, forward-only passes in train mode; 28 per-token loss over EOD
# masks with MTP 2 and recomputation, regathering, a second model; 37 an abandoned forward,
# recomputation, Ulysses; 56 MLA, MoE, per-token loss over EOD masks, an abandoned forward;
# 85 learnable sinks on packed documents, recomputation; 110 CP16 with team size 4,
# recomputation; 111 interleaved stages, MLA, recomputation, MTP 2, Ulysses, regathering.
# The dimensions drawn after the rest (their own stream, model_fuzz._draw_wrappers) give these:
# 4 the max-logit log, pack/unpack hooks; 20 every layer in torch's reentrant checkpoint,
# save_on_cpu; 37 the max-logit log, torch's non-reentrant checkpoint; and 165 adds --qk-clip
# (clipping from step 1, qk-layernorm, per-token loss over EOD masks, save_on_cpu) in place of
# draw 2 (8 ranks against 2; its one feature no other fixed draw has, off-by-one sinks, is
# test_gpt_sinks.py's at model level). Draw 12 (hybrid CP over 8 with full recomputation, the
# slice's slowest: 42 s of a 30-min suite) left it for the suite's time (issue 56): the same
# layout, recomputation and packed samples train as CP = 1 in
# test_recompute.py::test_hybrid_context_parallelism_with_full_recomputation_trains_as_cp1, now
# with its GQA 8/2 too; it stays in the committed table.
FIXED = [int(i) for i in os.environ.get("STARTRAIL_FUZZ_FIXED", "").split(",") if i] or [
    4, 11, 20, 28, 37, 56, 85, 110, 111, 165]
RANDOM_DRAWS = int(os.environ.get("STARTRAIL_FUZZ_DRAWS", "4"))


def commit_seed() -> int:
    """A seed from the checked-out commit (the same draws for every run of one commit)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        head = "no-git"
    return int(hashlib.sha256(head.encode()).hexdigest()[:8], 16)


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    return model_fuzz.documents(str(tmp_path_factory.mktemp("fuzz")))


def _check(seed: int, index: int, documents: str):
    result = model_fuzz.run_draw(model_fuzz.draw(seed, index, documents))
    print(f"model fuzz {result['name']}: {result['status']} ({', '.join(result['features'])}) "
          f"{result.get('grad_error', '')} {result.get('reason') or ''}"[:400])
    assert result["status"] in ("exact", "refused", "skipped"), (
        f"draw {seed}:{index} {result['status']}: reproduce with python -m benchmarks.accuracy.model_fuzz --seed {seed} "
        f"--first {index} --draws 1 --no-write", result)
    return result


@pytest.mark.parametrize("index", FIXED)
def test_a_fixed_slice_of_draws_equals_cp1(index, documents):
    _check(MAIN_SEED, index, documents)


# The commit's draws share a budget of ranks: on CI's 2 cores a draw costs roughly its rank
# count (an 8-rank draw 25-45 CPU-s), so four draws of up to 8 ranks each swung the suite's time
# with the commit hash: 77 s on one commit (draws of 4, 8, 2, 2 ranks), 113 s on the next (four of
# 8). Draws are taken in order, each one that fits what is left of the budget, up to
# RANDOM_DRAWS: 2-4 draws, at most 20 ranks in all. CP16 and the larger worlds stay in the fixed
# slice (draw 110) and the committed tables.
MAX_RANKS = 8
RANK_BUDGET = int(os.environ.get("STARTRAIL_FUZZ_RANK_BUDGET", "20"))


def commit_draws(seed: int, documents: str, count: int, budget: int = RANK_BUDGET) -> list[int]:
    """Up to ``count`` indices of ``seed``, in order, each draw taken when its StarTrail run fits
    what is left of ``budget`` ranks (and has at most MAX_RANKS): at least two draws."""
    indices, left, i = [], budget, 0
    while len(indices) < count and left >= 2 and i < 200:
        ranks = model_fuzz.draw(seed, i, documents).startrail_ranks
        if ranks <= min(MAX_RANKS, left):
            indices.append(i)
            left -= ranks
        i += 1
    return indices


def test_draws_from_the_commits_seed_equal_cp1(documents):
    seed = commit_seed()
    indices = commit_draws(seed, documents, RANDOM_DRAWS)
    print(f"model fuzz: commit seed {seed}, draws {indices}")
    statuses = [_check(seed, i, documents)["status"] for i in indices]
    assert len(statuses) >= min(2, RANDOM_DRAWS), indices


def test_the_commits_draws_fill_their_rank_budget_and_no_more(documents):
    # The seeds of the two commits the comment above measured (commit_seed of ec1947c, ff68a07).
    for seed, want in ((0x7CC002F1, [0, 1, 5]), (0xDCB4F516, [0, 1, 2, 3])):
        indices = commit_draws(seed, documents, 4, budget=20)
        ranks = [model_fuzz.draw(seed, i, documents).startrail_ranks for i in indices]
        assert indices == want and sum(ranks) <= 20 and max(ranks) <= MAX_RANKS, (seed, indices, ranks)
    assert commit_draws(0xDCB4F516, documents, 4, budget=6) == [0, 2]  # 4 + 2 ranks; draw 1's 8 skipped


def test_packed_documents_without_a_dense_twin_are_compared_with_startrails_attention_at_cp1(documents):
    """MTP, virtual stages or a window on packed documents (no MLA): no skip, the reference is the
    same packed sample at CP = 1 through StarTrail's attention; otherwise Megatron's dense mask."""
    for index, why in ((27, "MTP 1"), (2, "VPP"), (14, "window 96 (schedule)")):
        d = model_fuzz.draw(20261128, index, documents)
        assert why in d.features and d.startrail_reference and d.skip_reason is None, (index, d)
        assert d.reference == ["--dataloader-inter-document-masking"], d.reference
    d = model_fuzz.draw(20261128, 0, documents)  # packed, none of the three: the dense twin
    assert not d.startrail_reference and "--reset-attention-mask" in d.reference
