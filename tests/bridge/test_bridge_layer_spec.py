"""``startrail_layer_spec`` without a distributed run: what it refuses (each error names the
Bridge setting to change), how it resolves the spec Bridge would have built (``vp_stage``),
and the packed layout it tells the attention."""

from __future__ import annotations

import pytest
import torch

from tests.bridge import require_bridge

require_bridge()

# Bridge, imported with the stand-ins (recipe_run), then what the tests use
from tests.bridge.recipe_run import gpt_provider  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.enums import AttnBackend  # noqa: E402

from megatron_startrail.bridge import startrail_layer_spec  # noqa: E402
from megatron_startrail.bridge.checks import StarTrailBridgeError  # noqa: E402
from megatron_startrail.bridge.packed_layout import BRIDGE_ATTENTION, as_document_layout  # noqa: E402
from megatron_startrail.megatron.layer_specs import PACKED_DOCUMENT_ATTENTION  # noqa: E402


def provider(**settings):
    fields = dict(num_layers=2, hidden_size=64, num_attention_heads=8, context_parallel_size=4,
                  attention_dropout=0.0, hidden_dropout=0.0)
    return gpt_provider.GPTModelProvider(**{**fields, **settings})


def refusal(**settings) -> str:
    spec = startrail_layer_spec(team_size=2, base=gpt_provider.local_layer_spec)
    with pytest.raises(StarTrailBridgeError) as error:
        spec(provider(**settings))
    return str(error.value)


def test_the_local_attention_backend_is_refused_by_name():
    # Bridge would overwrite the core attention with DotProductAttention: StarTrail gone silently.
    message = refusal(attention_backend=AttnBackend.local)
    assert "model.attention_backend=AttnBackend.local" in message and "DotProductAttention" in message


@pytest.mark.parametrize("setting, value, named", [
    ("cp_comm_type", "a2a", "model.cp_comm_type='a2a'"),
    ("attention_dropout", 0.1, "model.attention_dropout=0.1"),
    ("hybrid_context_parallel", True, "model.hybrid_context_parallel=True"),
])
def test_settings_that_do_not_compose_are_refused_by_name(setting, value, named):
    assert named in refusal(**{setting: value})


def test_without_megatrons_global_parallel_state_decentralized_groups_are_named():
    # The pytest process never initializes parallel_state (ranks run in forks), as with
    # dist.use_decentralized_pg=True, where Bridge makes a HyperCommGrid instead.
    assert "dist.use_decentralized_pg=False" in refusal()


def test_settings_are_checked_when_the_spec_is_made():
    with pytest.raises(StarTrailBridgeError, match="team_size='auto'"):
        startrail_layer_spec(team_size="auto")
    with pytest.raises(StarTrailBridgeError, match="unknown settings \\['team'\\]"):
        startrail_layer_spec(team_size=2, team=2)
    with pytest.raises(ValueError, match="backward_rotation='x'"):
        startrail_layer_spec(team_size=2, backward_rotation="x")


def test_the_base_spec_is_resolved_as_bridge_resolves_a_function():
    seen = []

    def with_stage(config, vp_stage=None):
        seen.append(("with", vp_stage))
        return "spec"

    def without_stage(config):
        seen.append(("without", None))
        return "spec"

    model = provider()
    assert startrail_layer_spec(team_size=2, base=with_stage).base_spec(model, 3) == "spec"
    assert startrail_layer_spec(team_size=2, base=without_stage).base_spec(model, 3) == "spec"
    local = gpt_provider.local_layer_spec(model)
    assert startrail_layer_spec(team_size=2, base=local).base_spec(model, 1) is local  # a ModuleSpec as it is
    assert seen == [("with", 3), ("without", None)]


def test_bridge_calls_it_with_vp_stage():
    import inspect  # noqa: PLC0415

    assert "vp_stage" in inspect.signature(startrail_layer_spec(team_size=2)).parameters


def test_packed_batches_reach_the_attention_in_bridges_per_document_layout():
    cu = torch.tensor([0, 8, 24, 32], dtype=torch.int32)
    real_only = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=16, max_seqlen_kv=16)
    document = as_document_layout(real_only)
    assert document.cu_seqlens_q_padded is cu and document.cu_seqlens_kv_padded is cu  # each document its own span
    assert real_only.cu_seqlens_q_padded is None  # Bridge's object is left as it was
    padded = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu - 0, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                             cu_seqlens_kv_padded=cu)
    assert as_document_layout(padded) is padded
    assert as_document_layout(None) is None
    for megatron, startrail in PACKED_DOCUMENT_ATTENTION.items():  # the same modules, on Bridge's layout
        assert issubclass(BRIDGE_ATTENTION[megatron], startrail)
