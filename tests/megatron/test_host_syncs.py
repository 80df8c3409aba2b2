"""Per-micro-batch metadata: a packed-document GPT of 4 layers (standard attention, or
Multi-Latent Attention with its own RoPE table) makes at most one host sync and one agreement
collective per micro-batch in StarTrail's code, not one or more per layer.

On a GPU every host sync (``tolist``, ``item``, ``int(tensor)``, ``cpu``, ``torch.equal``, ...)
stalls the launch queue; Megatron computes per-micro-batch metadata once. CPU tensors cannot
show a stall, so the test counts the calls that would be one, made from megatron_startrail's
own frames (Megatron's own are Megatron's business), with a TorchFunctionMode.
"""

import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tests.megatron.utils import HIDDEN, HEADS, VOCAB, Utils, parallel_state  # noqa: F401 (import shims first)
from tests.multiproc import run_ranks

from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig  # noqa: E402

from megatron_startrail.megatron.layer_specs import to_startrail_spec  # noqa: E402
from megatron_startrail.megatron.parallel_state import initialize_startrail  # noqa: E402

LAYERS, SEQ, MICRO_BATCHES = 4, 64, 3
# Tensor methods that wait for the device on a GPU (a data-dependent result on the host).
SYNCS = {"tolist", "item", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy", "equal", "nonzero"}


class HostSyncCounter(TorchFunctionMode):
    """Counts, by name, the syncing calls whose caller is a megatron_startrail source file."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNCS:
            caller = sys._getframe(1).f_code.co_filename  # the line that made the call
            if "megatron_startrail" in caller and "/tests/" not in caller:
                self.calls.append(f"{name} at {caller.rsplit('/', 1)[-1]}:{sys._getframe(1).f_lineno}")
        return func(*args, **(kwargs or {}))


def packed_sample(micro_batch: int, cp: int, cp_rank: int):
    """A packed sample (sample layout) of random documents: this rank's tokens and positions,
    and fresh PackedSeqParams, as Megatron builds them for every micro-batch."""
    gen = torch.Generator().manual_seed(100 + micro_batch)
    cuts = sorted(torch.randperm(SEQ - 1, generator=gen)[:3].add(1).tolist())
    cu = torch.tensor([0, *cuts, SEQ], dtype=torch.int32)
    tokens = torch.randint(0, VOCAB, (SEQ,), generator=gen)
    positions = torch.cat([torch.arange(int(b - a)) for a, b in zip(cu[:-1], cu[1:])])
    chunk = SEQ // (2 * cp)
    held = torch.cat([torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk),
                      torch.arange((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk)])
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=int((cu[1:] - cu[:-1]).max()), max_seqlen_kv=int((cu[1:] - cu[:-1]).max()))
    return tokens[held][None], positions[held][None], params


def sync_worker(rank, world_size, team_size, mla):
    Utils.initialize_model_parallel(context_parallel_size=world_size)
    torch.manual_seed(0)
    common = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, use_cpu_initialization=True,
                  context_parallel_size=world_size, hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False)
    config = (MLATransformerConfig(**common, q_lora_rank=None, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=8,
                                   v_head_dim=4, rope_type="rope") if mla else TransformerConfig(**common))
    groups = initialize_startrail(team_size)
    spec = to_startrail_spec(get_gpt_layer_local_spec(multi_latent_attention=mla), groups)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                     position_embedding_type="rope")
    agreements = []
    start = groups.transport.collective
    groups.transport.collective = lambda fn, *a, group, label, **kw: (
        agreements.append(label) if label == "document_check" else None,
        start(fn, *a, group=group, label=label, **kw))[1]
    per_micro_batch = []
    for micro_batch in range(MICRO_BATCHES):
        tokens, positions, params = packed_sample(micro_batch, world_size, parallel_state.get_context_parallel_rank())
        agreements.clear()
        with HostSyncCounter() as counter:
            loss = model(tokens, positions, None, labels=tokens, packed_seq_params=params)
            loss.float().sum().backward()
        per_micro_batch.append((counter.calls, len(agreements)))
    Utils.destroy_model_parallel()
    return per_micro_batch


@pytest.mark.parametrize("mla", [False, True], ids=["attention", "mla"])
def test_packed_gpt_syncs_once_per_micro_batch_not_per_layer(mla):
    for per_micro_batch in run_ranks(sync_worker, 4, args=(2, mla), timeout=180):
        assert len(per_micro_batch) == MICRO_BATCHES
        for calls, agreements in per_micro_batch:
            assert len(calls) <= 1, calls  # 4 layers: the one sync of the document agreement
            assert agreements == 1  # one agreement collective over the CP group, by the first layer
