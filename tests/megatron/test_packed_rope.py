"""RoPE of packed documents in the sample layout (megatron_startrail/megatron/packed_rope.py):
every token a CP rank holds is rotated by its per-document position, as at CP = 1."""

import types

import pytest

from tests.megatron.utils import cpu_patches  # noqa: F401  (import shims before megatron)

import torch  # noqa: E402
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd  # noqa: E402
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from megatron_startrail.megatron.packed_rope import apply_rotary_pos_emb, sample_layout_positions  # noqa: E402
from tests.attention_cases import local_rows  # noqa: E402


def random_cu_seqlens(total, seed):
    """Document lengths 1, 2, 3, ... mixed with longer ones, summing to ``total``."""
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 2, 3]
    while sum(lengths) < total:
        lengths.append(int(torch.randint(1, total // 2, (1,), generator=g)))
    lengths[-1] -= sum(lengths) - total
    lengths = [n for n in lengths if n > 0]
    lengths = [lengths[i] for i in torch.randperm(len(lengths), generator=g)]
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def document_position_ids(cu_seqlens):
    """What GPTDataset writes with --dataloader-inter-document-masking: 0, 1, ... in every document."""
    return torch.cat([torch.arange(int(e - s)) for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:])])


@pytest.mark.parametrize("cp_size", [1, 2, 4, 8])
def test_positions_are_the_datasets_position_ids_on_this_rank(cp_size):
    total = 16 * cp_size * 3
    cu_seqlens = random_cu_seqlens(total, seed=cp_size)
    full = document_position_ids(cu_seqlens)
    for cp_rank in range(cp_size):
        got = sample_layout_positions(cu_seqlens, cp_size, cp_rank)
        assert torch.equal(got, local_rows(full, cp_rank, cp_size))


def test_a_sample_not_divisible_by_2cp_is_a_value_error():
    with pytest.raises(ValueError, match="context-parallel-size"):
        sample_layout_positions(torch.tensor([0, 5, 10], dtype=torch.int32), 2, 0)


class FakeCPGroup:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def test_rotation_on_a_cp_rank_equals_rotating_the_whole_sample():
    """The sample rotated per document in float64 at CP = 1, then zigzagged, equals what a
    CP rank computes from its own tokens; Megatron's THD RoPE (per-document layout) does not."""
    cp_size, total, heads, dim = 4, 128, 2, 16
    config = TransformerConfig(num_layers=1, hidden_size=heads * dim, num_attention_heads=heads,
                               use_cpu_initialization=True, apply_rope_fusion=False)
    rope = RotaryEmbedding(kv_channels=dim, rotary_percent=1.0, use_cpu_initialization=True)
    cu_seqlens = random_cu_seqlens(total, seed=7)
    freqs = rope.get_freqs_non_repeated(int((cu_seqlens[1:] - cu_seqlens[:-1]).max())).double()
    table = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]  # RotaryEmbedding.get_emb: [max_seqlen, 1, 1, d]
    q = torch.randn(total, 1, heads, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    whole = apply_rotary_pos_emb(q, table[document_position_ids(cu_seqlens)], config=config,
                                 cp_group=FakeCPGroup(1, 0))
    differs = False
    for cp_rank in range(cp_size):
        group = FakeCPGroup(cp_size, cp_rank)
        local = local_rows(q, cp_rank, cp_size)
        got = apply_rotary_pos_emb(local, table[sample_layout_positions(cu_seqlens, cp_size, cp_rank)],
                                   config=config, cp_group=group)
        torch.testing.assert_close(got, local_rows(whole, cp_rank, cp_size), rtol=0, atol=1e-12)
        try:  # what Megatron's attention would do with these PackedSeqParams
            megatron_thd = _apply_rotary_pos_emb_thd(local.squeeze(1), cu_seqlens, table, cp_group=group)
            differs |= not torch.allclose(megatron_thd, got.squeeze(1))
        except RuntimeError:  # document lengths not divisible by CP: Megatron's split fails
            differs = True
    assert differs


def test_no_rope_layers_are_left_to_megatron(monkeypatch):
    """--no-rope-freq: on a no-RoPE layer Megatron drops the rotary embedding inside
    Attention.forward, so the sample-layout wrapper must not rotate there; on a RoPE layer
    of the same model it does."""
    from megatron.core.transformer.attention import SelfAttention  # noqa: PLC0415
    from megatron.core.packed_seq_params import PackedSeqParams  # noqa: PLC0415

    from megatron_startrail.megatron.packed_rope import PackedRopeSelfAttention  # noqa: PLC0415

    seen = []
    def megatron_forward(self, hidden, mask=None, **kwargs):  # what reaches Megatron's own forward
        seen.append((kwargs["rotary_pos_emb"], self._sample_layout_freqs))

    monkeypatch.setattr(SelfAttention, "forward", megatron_forward)
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    table = torch.randn(16, 1, 1, 8)
    for layer_number, rotated in ((1, True), (2, False)):
        layer = object.__new__(PackedRopeSelfAttention)  # no parameters needed: forward is stubbed
        config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, no_rope_freq=[0, 1],
                                   use_cpu_initialization=True)
        pg_collection = types.SimpleNamespace(cp=FakeCPGroup(2, 0))
        for name, value in (("config", config), ("layer_number", layer_number), ("pg_collection", pg_collection)):
            object.__setattr__(layer, name, value)
        layer.forward(torch.randn(8, 1, 16), None, rotary_pos_emb=table, packed_seq_params=params)
        passed, freqs = seen.pop()
        if rotated:  # the wrapper rotates (Megatron's own RoPE gets nothing)
            assert passed is None and freqs is not None
        else:  # Megatron's forward gets the table back, to drop it itself
            assert passed is table and freqs is None


def test_sample_layout_positions_with_sequence_parallel(monkeypatch):
    """--sequence-parallel: the attention input holds t / (CP * TP) rows, q and k t / CP; every
    held row still gets its own position (the table rows match q's rows, not the input's)."""
    from megatron.core.transformer.attention import SelfAttention  # noqa: PLC0415
    from megatron.core.packed_seq_params import PackedSeqParams  # noqa: PLC0415

    from megatron_startrail.megatron.packed_rope import PackedRopeSelfAttention  # noqa: PLC0415

    seen = []
    monkeypatch.setattr(SelfAttention, "forward", lambda self, *a, **k: seen.append(self._sample_layout_freqs))
    cp, tp, total = 2, 2, 24
    cu = torch.tensor([0, 5, total], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    table = torch.randn(total, 1, 1, 8)
    layer = object.__new__(PackedRopeSelfAttention)  # forward is stubbed: no parameters needed
    config = types.SimpleNamespace(no_rope_freq=None, sequence_parallel=True, tensor_model_parallel_size=tp)
    for name, value in (("config", config), ("layer_number", 1),
                        ("pg_collection", types.SimpleNamespace(cp=FakeCPGroup(cp, 1)))):
        object.__setattr__(layer, name, value)
    layer.forward(torch.randn(total // (cp * tp), 1, 16), None, rotary_pos_emb=table, packed_seq_params=params)
    q_freqs, k_freqs = seen.pop()
    want = table[local_rows(document_position_ids(cu), 1, cp)]  # rank 1's rows of the whole sample
    assert torch.equal(q_freqs, want) and torch.equal(k_freqs, want)
