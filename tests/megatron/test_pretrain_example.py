"""examples/pretrain_gpt.py end to end (megatron.training's parse_args and pretrain, DDP,
Adam, LR schedule, Megatron's datasets and data loader): CP4 with StarTrail (x TP2 or x PP2)
logs the losses of the same command with --context-parallel-size 1; packed documents
(--dataloader-inter-document-masking) with StarTrail CP4 log the losses of Megatron's dense
per-document mask (--reset-attention-mask --reset-position-ids) at CP 1."""

import argparse
import contextlib
import io
import math
import os
import re

import pytest
import torch

from tests.megatron.example import pretrain_gpt, run_example_rank
from tests.megatron.utils import assert_first_step_grads_match, record_first_step_grads
from tests.multiproc import run_ranks


COMMON = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8",
    "--seq-length", "256", "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "4",
    "--lr", "3e-3", "--lr-warmup-iters", "1", "--seed", "1234", "--log-interval", "1",
]
LOG_LINE = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.* lm loss: ([0-9.E+-]+) \|.* tokens/s: ([0-9.]+) \|")


def example_worker(rank, world_size, argv):
    """The logged (iteration, iterations, lm loss, tokens/s); on rank 0 also the first step's
    gradients after Megatron's DDP reduction (rank 0 is TP, PP, CP and DP rank 0 in any grid)."""
    recorded = record_first_step_grads()
    log = run_example_rank(rank, world_size, argv)
    lines = [(int(m[1]), int(m[2]), float(m[3]), float(m[4])) for m in LOG_LINE.finditer(log)]
    return lines, recorded.get("grads") if rank == 0 else None


def losses_and_grads(world_size, *flags, iters=4):
    """The logged losses (last rank) and global rank 0's first-step gradients by name."""
    logged = run_ranks(example_worker, world_size, args=([*COMMON, *flags],), timeout=240)
    lines = logged[-1][0]  # megatron.training logs on the last rank
    assert [(i, n) for i, n, _, _ in lines] == [(i, iters) for i in range(1, iters + 1)]
    assert all(tokens_per_s > 0 for *_, tokens_per_s in lines)
    return [loss for _, _, loss, _ in lines], logged[0][1]


def losses(world_size, *flags, iters=4):
    return losses_and_grads(world_size, *flags, iters=iters)[0]


@pytest.mark.parametrize("grid", [
    ["--tensor-model-parallel-size", "2"],
    ["--pipeline-model-parallel-size", "2"],
], ids=["TP2", "PP2"])
def test_startrail_cp4_logs_the_losses_of_cp1(grid):
    startrail, grads = losses_and_grads(8, *grid, "--context-parallel-size", "4", "--context-parallel-algo",
                                        "startrail", "--startrail-team-size", "2")
    reference, ref_grads = losses_and_grads(2, *grid, "--context-parallel-size", "1")
    assert all(math.isfinite(x) for x in startrail + reference)
    for got, want in zip(startrail, reference):
        assert abs(got - want) <= 2e-6 * want, (startrail, reference)
    assert_first_step_grads_match(grads, ref_grads, f"example {grid[0]} CP4")  # per parameter (issue 36)
    assert reference[-1] < reference[0]  # it learns


# DeepSeek-style MLA at toy size: q/k head dim 32 + 16 (RoPE part), v head dim 16.
MLA = ["--multi-latent-attention", "--qk-head-dim", "32", "--qk-pos-emb-head-dim", "16", "--v-head-dim", "16",
       "--kv-lora-rank", "32", "--rope-type", "rope"]  # yarn's RoPE table needs a GPU in megatron-core 0.19.2


def test_mla_startrail_cp4_with_and_without_regathering_logs_the_losses_of_cp1():
    reference, ref_grads = losses_and_grads(1, *MLA, "--context-parallel-size", "1")
    startrail = ["--context-parallel-size", "4", "--context-parallel-algo", "startrail", "--startrail-team-size", "2"]
    for extra in ([], ["--startrail-regather-in-backward"]):
        got, grads = losses_and_grads(4, *MLA, *startrail, *extra)
        assert all(math.isfinite(x) for x in got + reference)
        for g, want in zip(got, reference):
            assert abs(g - want) <= 1e-4 * want, (extra, got, reference)
        assert_first_step_grads_match(grads, ref_grads, f"example MLA CP4 {extra}")
    assert reference[-1] < reference[0]


def test_tokens_per_second_is_read_off_megatrons_line():
    from megatron_startrail.megatron.training_log import with_tokens_per_second

    line = (" [2026-01-01 00:00:00.000000] iteration        5/      30 | consumed samples:           20 |"
            " elapsed time per iteration (ms): 400.0 | learning rate: 1.0E-03 | global batch size:     4 |"
            " lm loss: 4.602513E+00 | loss scale: 1.0 |")
    assert with_tokens_per_second(line, 2048) == line + " tokens/s: 20480.0 |"  # 4 x 2048 / 0.4 s
    assert with_tokens_per_second("done with setup ...", 2048) == "done with setup ..."


def test_packed_documents_with_startrail_log_the_losses_of_megatrons_dense_document_mask(tmp_path):
    # Short documents (make_indexed_dataset.short_documents): every 256-token sample packs many,
    # of length 1, shorter than 2*CP and longer than a CP chunk.
    make = pretrain_gpt.make_indexed_dataset
    make.write_indexed_dataset(make.short_documents(), str(tmp_path / "docs"))
    data = ["--data-path", str(tmp_path / "docs"), "--split", "100,0,0",
            "--tensor-model-parallel-size", "2"]
    packed, grads = losses_and_grads(8, *data, "--context-parallel-size", "4", "--context-parallel-algo",
                                     "startrail", "--startrail-team-size", "2", "--dataloader-inter-document-masking")
    dense_mask, ref_grads = losses_and_grads(2, *data, "--context-parallel-size", "1", "--reset-attention-mask",
                                             "--reset-position-ids")
    no_mask = losses(2, *data, "--context-parallel-size", "1")
    assert all(math.isfinite(x) for x in packed + dense_mask + no_mask)
    for got, want in zip(packed, dense_mask):
        assert abs(got - want) <= 1e-4 * want, (packed, dense_mask)
    assert_first_step_grads_match(grads, ref_grads, "example packed TP2 CP4")
    # Document masking changes the losses, by 10x more than the agreement allowed above
    # (measured: up to 6.6e-3 relative at iteration 4).
    assert max(abs(a - b) / b for a, b in zip(dense_mask, no_mask)) > 1e-3, (dense_mask, no_mask)


def test_mla_packed_documents_with_startrail_log_the_losses_of_cp1_packed_mla(tmp_path):
    """MLA rotates by sequence position (not --reset-position-ids), so its CP = 1 twin reads the
    same packed documents (THD, LocalMLACoreAttention's per-document mask) instead of a dense mask."""
    make = pretrain_gpt.make_indexed_dataset
    make.write_indexed_dataset(make.short_documents(), str(tmp_path / "docs"))
    data = [*MLA, "--data-path", str(tmp_path / "docs"), "--split", "100,0,0"]
    packed, grads = losses_and_grads(4, *data, "--context-parallel-size", "4", "--context-parallel-algo",
                                     "startrail", "--startrail-team-size", "2", "--dataloader-inter-document-masking")
    reference, ref_grads = losses_and_grads(1, *data, "--context-parallel-size", "1",
                                            "--dataloader-inter-document-masking")
    no_mask = losses(1, *data, "--context-parallel-size", "1")
    assert all(math.isfinite(x) for x in packed + reference + no_mask)
    for got, want in zip(packed, reference):
        assert abs(got - want) <= 1e-5 * want, (packed, reference)
    assert_first_step_grads_match(grads, ref_grads, "example packed MLA CP4")
    assert max(abs(a - b) / b for a, b in zip(reference, no_mask)) > 1e-3, (reference, no_mask)


def test_packed_documents_need_startrail_with_megatrons_local_attention():
    # (--reset-attention-mask with StarTrail is refused by validate_startrail_args: test_arguments.py)
    args = argparse.Namespace(context_parallel_algo="megatron", context_parallel_size=1, transformer_impl="local",
                              dataloader_inter_document_masking=True, sft=False, multi_latent_attention=False,
                              reset_attention_mask=False)
    with pytest.raises(ValueError, match="use --reset-attention-mask --reset-position-ids"):
        pretrain_gpt.validate_example_args(args)
    args.multi_latent_attention = True  # at CP = 1 LocalMLACoreAttention takes packed documents
    pretrain_gpt.validate_example_args(args)
    args.dataloader_inter_document_masking, args.reset_attention_mask = False, True
    with pytest.raises(ValueError, match="--reset-attention-mask with --multi-latent-attention"):
        pretrain_gpt.validate_example_args(args)  # MLA cannot take the dense per-document mask
    args = argparse.Namespace(context_parallel_algo="startrail", context_parallel_size=4, transformer_impl="local",
                              dataloader_inter_document_masking=True, sft=False, multi_latent_attention=False,
                              reset_attention_mask=False)
    pretrain_gpt.validate_example_args(args)  # accepted


def batches_worker(rank, world_size, argv):
    """Run the example; return a digest of every micro-batch this rank's get_batch gave."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    digests, read = [], pretrain_gpt.get_batch

    def recording(data_iterator, vp_stage=None):
        batch = read(data_iterator, vp_stage)
        tokens = batch["tokens"].long()
        digests.append((int(tokens.sum()), int((tokens * torch.arange(tokens.numel()).view_as(tokens)).sum()),
                        batch["cu_seqlens"].tolist(), int(batch["position_ids"].sum())))
        return batch

    pretrain_gpt.get_batch = recording  # in this forked rank only
    with contextlib.redirect_stdout(io.StringIO()):
        pretrain_gpt.main(argv)
    return digests


def test_resumed_run_reads_the_batches_of_an_uninterrupted_run(tmp_path):
    """--save after 2 iterations, --load, 2 more: Megatron's sampler restarts at the consumed
    samples, so every rank gets the packed micro-batches (tokens, cu_seqlens, position ids) of
    iterations 3-4 of an uninterrupted 4-iteration run."""
    make = pretrain_gpt.make_indexed_dataset
    make.write_indexed_dataset(make.short_documents(), str(tmp_path / "docs"))
    argv = [*COMMON, "--data-path", str(tmp_path / "docs"), "--split", "100,0,0",
            "--context-parallel-size", "2", "--context-parallel-algo",
            "startrail", "--startrail-team-size", "1", "--dataloader-inter-document-masking",
            "--ckpt-format", "torch", "--lr-decay-iters", "4"]
    checkpoint = str(tmp_path / "checkpoint")
    full = run_ranks(batches_worker, 2, args=(argv,), timeout=240)
    run_ranks(batches_worker, 2, args=([*argv, "--train-iters", "2", "--save", checkpoint, "--save-interval", "2"],),
              timeout=240)
    resumed = run_ranks(batches_worker, 2, args=([*argv, "--load", checkpoint,
                                                  "--use-checkpoint-opt_param-scheduler"],), timeout=240)
    for rank in range(2):
        # global batch 2 = 2 micro-batches per iteration: 8 different ones in 4 iterations
        assert len(full[rank]) == 8 and len(set(map(str, full[rank]))) == 8
        assert resumed[rank] == full[rank][4:], rank
    assert any(len(d[2][0]) > 3 for d in full[0])  # the samples really pack several documents


@pytest.mark.parametrize("window", [["--window-size", "24,0"], ["--window-size", "100,0"]], ids=["halo", "schedule"])
def test_mla_with_a_sliding_window_startrail_cp4_gives_cp1s_gradients(window):
    # The CP = 1 twin (LocalMLACoreAttention) applies the window too: without it the two runs
    # would agree only if neither did (on 9c6fece the CP = 1 losses were the same with and
    # without --window-size). 24 < a CP4 chunk of 32 rows: the halo exchange; 100: the schedule.
    flags = [*MLA, *window, "--window-attn-skip-freq", "2"]  # layer 1 windowed, layer 2 full
    reference, ref_grads = losses_and_grads(1, *flags, "--context-parallel-size", "1")
    unwindowed, _ = losses_and_grads(1, *MLA, "--context-parallel-size", "1")
    assert reference != unwindowed  # the CP = 1 twin's window is applied
    got, grads = losses_and_grads(4, *flags, "--context-parallel-size", "4", "--context-parallel-algo", "startrail",
                                  "--startrail-team-size", "2")
    for g, want in zip(got, reference):
        assert abs(g - want) <= 2e-6 * want, (got, reference)
    assert_first_step_grads_match(grads, ref_grads, f"example MLA CP4 {' '.join(window)}")
