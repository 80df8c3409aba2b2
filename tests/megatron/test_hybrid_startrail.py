"""megatron-core's HybridModel with StarTrail: the stack spec's attention layers, and only
they, get StarTrail core attention; a tiny attention/MLP HybridModel at TP2 x CP4 (team
size 2) trains with the losses and the first step's per-parameter gradients (relative 1e-5) of the
same model at CP1.
The same through examples/pretrain_gpt.py: test_hybrid_example.py.

The pattern "*-*-" is attention, MLP, attention, MLP (Mamba layers need GPU kernels). Weights
come from the same CPU seeds in both worlds (asserted); losses are summed over tokens and
gradients over the DP x CP group, then compared, as in test_gpt_startrail.py.
"""

import pytest
import torch

from tests.megatron.utils import (  # first: the CPU import shims before megatron.core
    HEADS,
    HIDDEN,
    SEQ,
    VOCAB,
    TransformerConfig,
    Utils,
    initialize_startrail,
    parallel_state,
    sample_batch,
    train_steps,
    worst_grad_error,
)

from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec  # noqa: E402
from megatron.core.models.hybrid.hybrid_model import HybridModel  # noqa: E402
from megatron.core.ssm.mamba_context_parallel import (  # noqa: E402
    _redo_attention_load_balancing,
    _undo_attention_load_balancing,
)

from megatron_startrail.layout import zigzag_chunks  # noqa: E402
from megatron_startrail.megatron.core_attention import StarTrailCoreAttention  # noqa: E402
from megatron_startrail.megatron.hybrid_specs import (  # noqa: E402
    UnavailableLayer,
    check_startrail_hybrid_pattern,
    hybrid_local_stack_spec,
    to_startrail_hybrid_spec,
)
from megatron_startrail.megatron.packed_mla import PackedRopeMLASelfAttention  # noqa: E402
from megatron_startrail.megatron.packed_rope import PackedRopeSelfAttention  # noqa: E402
from tests.multiproc import run_ranks  # noqa: E402

PATTERN = "*-*-"
STEPS, LR = 4, 1e-2
SLOTS = ("mamba_layer", "gdn_layer", "attention_layer", "dsa_layer", "mla_layer", "mlp_layer", "moe_layer",
         "mtp_block_spec")


def converted_slots(spec):
    groups = object()  # the conversion only stores the groups in the core attention's params
    out = to_startrail_hybrid_spec(spec, groups)
    return groups, out, {slot: getattr(out.submodules, slot) for slot in SLOTS}


@pytest.mark.parametrize("which", ["megatron_te", "local"])
def test_conversion_replaces_every_attention_core_and_nothing_else(which):
    """Megatron's own (Transformer Engine) hybrid stack spec, and the local one: '*' and '+'
    layers get StarTrail core attention (its settings in the groups' config), 'D' refuses to build,
    every other slot is the same object, and the input spec is not modified."""
    spec = hybrid_stack_spec if which == "megatron_te" else hybrid_local_stack_spec(num_experts=4)
    before = {slot: getattr(spec.submodules, slot) for slot in SLOTS}
    before_cores = {slot: before[slot].submodules.self_attention.submodules.core_attention
                    for slot in ("attention_layer", "mla_layer") if before[slot].submodules is not None}
    groups, out, after = converted_slots(spec)
    assert out.module is spec.module and out is not spec
    assert {slot: getattr(spec.submodules, slot) for slot in SLOTS} == before  # input untouched
    assert all(before[slot].submodules.self_attention.submodules.core_attention is core
               for slot, core in before_cores.items())
    # MLA ('+'): Megatron's MLASelfAttention becomes its per-document-RoPE version, as in GPT.
    converted = {"attention_layer": PackedRopeSelfAttention, "mla_layer": PackedRopeMLASelfAttention}
    if which == "local":
        del converted["mla_layer"]  # the local stack has no MLA layer (GPU-only): left refusing
    for slot, attention_module in converted.items():
        attention = after[slot].submodules.self_attention
        assert attention.module is attention_module
        core = attention.submodules.core_attention
        assert core.module is StarTrailCoreAttention
        assert core.params == dict(startrail_groups=groups)  # every setting travels with the groups' config
        # everything around the core attention is Megatron's spec
        keep = [name for name in vars(attention.submodules) if name != "core_attention"]
        assert all(getattr(attention.submodules, name) is getattr(before[slot].submodules.self_attention.submodules,
                                                                    name) for name in keep)
        assert after[slot].module is before[slot].module
    assert after["dsa_layer"].module is UnavailableLayer
    with pytest.raises(ValueError, match=r"--hybrid-layer-pattern .*'D'"):
        UnavailableLayer(**after["dsa_layer"].params)
    untouched = set(SLOTS) - set(converted) - {"dsa_layer"}
    assert all(after[slot] is before[slot] for slot in untouched)


def test_startrail_hybrid_pattern_refusals_name_the_flag():
    check_startrail_hybrid_pattern("*-*-", packed_sample_layout=True)
    check_startrail_hybrid_pattern("M*M-", packed_sample_layout=False)  # Megatron's own Mamba CP, dense layout
    with pytest.raises(ValueError, match="--dataloader-inter-document-masking"):
        check_startrail_hybrid_pattern("M*M-", packed_sample_layout=True)
    with pytest.raises(ValueError, match="--dataloader-inter-document-masking"):
        check_startrail_hybrid_pattern("G*-", packed_sample_layout=True)
    with pytest.raises(ValueError, match="--hybrid-layer-pattern"):
        check_startrail_hybrid_pattern("*D-", packed_sample_layout=False)


def test_megatron_mamba_cp_reorders_the_layout_startrail_uses():
    """Mamba/GDN layers keep Megatron's CP: after their all-to-all (CP rank 0's shard, then
    rank 1's, ...) ``_undo_attention_load_balancing`` must give back the sequence in order, for
    exactly the chunks StarTrail's attention assumes each CP rank holds (``zigzag_chunks``)."""
    cp, chunk = 4, 3
    sequence = torch.arange(2 * cp * chunk).view(-1, 1)  # [s, 1]
    chunks = sequence.split(chunk)
    gathered = torch.cat([chunks[c] for rank in range(cp) for c in zigzag_chunks(rank, cp)])
    assert torch.equal(_undo_attention_load_balancing(gathered, cp), sequence)
    assert torch.equal(_redo_attention_load_balancing(sequence, cp), gathered)


def tiny_hybrid(tp, cp, team_size, seed=1234):
    """A 4-layer HybridModel ("*-*-") on the local stack spec; StarTrail core attention when cp > 1."""
    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=len(PATTERN), hidden_size=HIDDEN, num_attention_heads=HEADS, use_cpu_initialization=True,
        tensor_model_parallel_size=tp, context_parallel_size=cp, hidden_dropout=0.0, attention_dropout=0.0,
        bias_dropout_fusion=False, batch_p2p_sync=False, pipeline_dtype=torch.float32, is_hybrid_model=True,
        calculate_per_token_loss=True,  # the schedule then leaves our summed loss unscaled
    )
    spec = hybrid_local_stack_spec()
    if cp > 1:
        spec = to_startrail_hybrid_spec(spec, initialize_startrail(team_size))
    return HybridModel(config=config, hybrid_stack_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                       hybrid_layer_pattern=PATTERN, position_embedding_type="rope")


def layer_kinds(model):
    """(layer class, attention class, core attention class) per decoder layer."""
    kinds = []
    for layer in model.decoder.layers:
        attention = layer.self_attention
        core = getattr(attention, "core_attention", None)
        kinds.append((type(layer).__name__, type(attention).__name__, type(core).__name__ if core else None))
    return kinds


def worker(rank, world_size, tp, cp, team_size):
    """STEPS steps of SGD on the summed gradients; per-step losses, the first step's grads."""
    Utils.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    model = tiny_hybrid(tp, cp, team_size)
    kinds = layer_kinds(model)
    weights = {n: p.detach().double().sum().item() for n, p in model.named_parameters()}
    losses, first_grads = train_steps(model, STEPS, LR, lambda step: sample_batch(10 * step))
    keep = parallel_state.get_context_parallel_rank() == 0
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    Utils.destroy_model_parallel()
    return (tp_rank, kinds, weights, first_grads, losses) if keep else None


def test_startrail_hybrid_tp2_cp4_matches_cp1():
    def collect(results):
        return {r[0]: r[1:] for r in results if r is not None}

    got = collect(run_ranks(worker, 8, args=(2, 4, 2), timeout=300))
    ref = collect(run_ranks(worker, 2, args=(2, 1, 1), timeout=300))
    assert set(got) == set(ref) == {0, 1}
    for tp_rank in ref:
        (kinds, w, g, losses), (rkinds, rw, rg, rlosses) = got[tp_rank], ref[tp_rank]
        # every attention layer runs StarTrail's core attention, the MLP layers are Megatron's
        assert kinds == [("TransformerLayer", "PackedRopeSelfAttention", "StarTrailCoreAttention"),
                         ("MLPLayer", "IdentityOp", None)] * 2, kinds
        assert rkinds == [("TransformerLayer", "SelfAttention", "DotProductAttention"),
                          ("MLPLayer", "IdentityOp", None)] * 2, rkinds
        assert w == rw, f"TP rank {tp_rank}: weights differ between the two builds"
        err, name = worst_grad_error(g, rg)  # per parameter (issue 36)
        print(f"hybrid TP rank {tp_rank}: worst relative grad error {err:.2e} ({name})")  # shown with -s
        assert err <= 1e-5, f"TP rank {tp_rank} {name}: relative grad error {err:.2e}"
        assert losses == pytest.approx(rlosses, rel=1e-5), f"losses {losses} vs CP=1 {rlosses}"

