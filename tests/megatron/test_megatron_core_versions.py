"""What the package supports on which megatron-core (README: "megatron-core 0.19.2 (0.16.1:
core attention, groups and GPT)"; megatron_startrail/megatron/versions.py).

Runs on any megatron-core. On 0.19 and newer the refusals are checked with the version
pretended to be 0.16.1; the ``megatron016`` tests run only on a real megatron-core 0.16.x,
which ``scripts/check_megatron_016.sh`` installs in a venv of its own and then runs these
tests, tests/megatron/test_core_attention.py (core attention), test_parallel_state.py and
test_cpu_patches.py (groups, CPU patches) and test_gpt_startrail.py (GPT against CP = 1).
"""

import pytest

from tests.megatron.utils import cpu_patches  # noqa: F401  (import shims before megatron)

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402

from megatron_startrail.megatron import hybrid_specs, layer_specs, versions  # noqa: E402
from megatron_startrail.megatron.core_attention import StarTrailCoreAttention  # noqa: E402
from megatron_startrail.megatron.packed_rope import PackedRopeSelfAttention  # noqa: E402

INSTALLED = versions.megatron_core_version()
megatron016 = pytest.mark.skipif(not INSTALLED.startswith("0.16."),
                                 reason=f"megatron-core {INSTALLED}: scripts/check_megatron_016.sh runs these")


@pytest.mark.parametrize("version, full", [
    ("0.16.1", False), ("0.18.0", False), ("0.19.0rc1", True), ("0.19.2", True), ("0.20.0", True), ("1.0.0", True),
])
def test_full_support_starts_at_0_19(version, full):
    assert versions.has_full_support(version) is full


@pytest.fixture
def pretend_0_16_1(monkeypatch):
    """On megatron-core >= 0.19: the version check sees 0.16.1 (on 0.16.x it does anyway)."""
    monkeypatch.setattr(versions, "megatron_core_version", lambda: "0.16.1")


def assert_names_the_versions(err):
    message = str(err.value)
    assert "megatron-core >= 0.19" in message and "installed: megatron-core 0.16.1" in message, message


def test_mla_is_refused_below_0_19_with_the_version_it_needs(pretend_0_16_1):
    spec = get_gpt_layer_local_spec(multi_latent_attention=True)
    with pytest.raises(versions.MegatronCoreTooOld) as err:
        layer_specs.to_startrail_spec(spec, groups=None)
    assert_names_the_versions(err)
    assert "Multi-Latent Attention" in str(err.value)


def test_hybrid_model_is_refused_below_0_19_with_the_version_it_needs(pretend_0_16_1, monkeypatch):
    if hybrid_specs.HybridStack is not None:  # what 0.16.1's missing megatron.core.models.hybrid leaves
        monkeypatch.setattr(hybrid_specs, "HybridStack", None)
    for build in (lambda: hybrid_specs.check_startrail_hybrid_pattern("*-*-", packed_sample_layout=False),
                  lambda: hybrid_specs.hybrid_local_stack_spec(),
                  lambda: hybrid_specs.to_startrail_hybrid_spec(None, groups=None)):
        with pytest.raises(versions.MegatronCoreTooOld) as err:
            build()
        assert_names_the_versions(err)
        assert "--hybrid-layer-pattern" in str(err.value)
    hybrid_specs.check_startrail_hybrid_pattern(None, packed_sample_layout=False)  # no pattern: nothing asked


def test_gpt_spec_converts_below_0_19(pretend_0_16_1):
    """The GPT layer spec (SelfAttention) is what 0.16.1 supports: converted, not refused."""
    spec = layer_specs.to_startrail_spec(get_gpt_layer_local_spec(), groups=None)
    attention = spec.submodules.self_attention
    assert attention.module is PackedRopeSelfAttention
    assert attention.submodules.core_attention.module is StarTrailCoreAttention


@megatron016
def test_on_megatron_core_0_16_the_package_imports_and_refuses_mla_and_hybrid():
    from megatron_startrail.megatron import from_args, packed_mla  # noqa: F401, PLC0415  (imports at all)

    assert INSTALLED.startswith("0.16.") and not versions.has_full_support()
    assert packed_mla.PackedRopeFusedMLASelfAttention is None and hybrid_specs.HybridStack is None
    with pytest.raises(versions.MegatronCoreTooOld) as err:
        layer_specs.to_startrail_spec(get_gpt_layer_local_spec(multi_latent_attention=True), groups=None)
    assert f"installed: megatron-core {INSTALLED}" in str(err.value)
    with pytest.raises(versions.MegatronCoreTooOld):
        hybrid_specs.check_startrail_hybrid_pattern("*-", packed_sample_layout=False)


@megatron016
def test_on_megatron_core_0_16_the_cpu_patches_apply():
    from tests.multiproc import run_ranks  # noqa: PLC0415

    def worker(rank, world_size):
        cpu_patches.apply()
        return cpu_patches.is_applied()

    assert run_ranks(worker, 1, timeout=60) == [True]
