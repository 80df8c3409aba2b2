"""Inconsistent packed lengths reaching StarTrail's core attention through Megatron's
``PackedSeqParams`` (CP 4, C=2): every rank raises the same ValueError, within a bounded
time, and only the one small agreement check (``megatron_startrail.documents``) has
communicated."""

import time

import pytest
import torch

from tests.megatron.utils import Utils
from tests.multiproc import run_ranks

from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from megatron_startrail.documents import CHECK_OP  # noqa: E402
from megatron_startrail.megatron.core_attention import StarTrailCoreAttention  # noqa: E402
from megatron_startrail.megatron.parallel_state import initialize_startrail  # noqa: E402

CP, HEADS, DIM, LOCAL_TOKENS = 4, 4, 8, 16


def packed_error_worker(rank, world_size, case):
    Utils.initialize_model_parallel(context_parallel_size=CP)
    groups = initialize_startrail(2)
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                               context_parallel_size=CP, attention_dropout=0.0, use_cpu_initialization=True)
    core = StarTrailCoreAttention(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                  attention_type="self", startrail_groups=groups)
    total = CP * LOCAL_TOKENS
    cu = [0, 5, 20, total]
    if case == "boundaries_differ" and rank == CP - 1:
        cu = [0, 5, 21, total]  # one rank's data loader disagrees on a document boundary
    elif case == "too_few_tokens":
        cu = [0, 5, 20, total - 3]  # cu_seqlens[-1] is not the packed sample's length
    cu = torch.tensor(cu, dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=total,
                             max_seqlen_kv=total)
    gen = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(LOCAL_TOKENS, HEADS, DIM, generator=gen) for _ in range(3))  # [t/CP, np, hn]
    start = time.monotonic()
    try:
        core(q, k, v, None, attn_mask_type=AttnMaskType.causal, attention_bias=None, packed_seq_params=params)
        outcome = None
    except ValueError as e:
        outcome = str(e)
    elapsed = time.monotonic() - start
    sent = set(groups.last_forward_stats.bytes_sent_by_op) if groups.last_forward_stats else set()
    Utils.destroy_model_parallel()  # a barrier: every rank got here, none is left waiting
    return outcome, sent, elapsed


@pytest.mark.parametrize("case, message", [
    ("boundaries_differ", "differ across the 4 context-parallel ranks"),
    ("too_few_tokens", "must equal the tokens"),
])
def test_inconsistent_packed_lengths_fail_on_every_rank(case, message):
    results = run_ranks(packed_error_worker, CP, args=(case,), timeout=120)
    for error, sent, elapsed in results:
        assert error is not None and message in error, error
        assert sent <= {CHECK_OP}, sent  # nothing but the agreement check communicated
        assert elapsed < 30, elapsed
    assert len({error for error, _, _ in results}) == 1, results  # one message, the same on every rank
