from setuptools import find_packages, setup

setup(
    name="megatron_startrail",
    version="0.1.0",
    description="StarTrail (concentric-ring) context parallelism for Megatron-LM",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["megatron_startrail", "megatron_startrail.*"]),
    python_requires=">=3.10",
    # torch 2.6: the group-relative ranks of c10d's P2P and rooted collectives
    # (P2POp(group_peer=), broadcast/reduce(group_src=/group_dst=)) that the transport uses.
    # megatron-core 0.16.1 (what pip picks on Python 3.11): core attention, groups, GPT
    # (scripts/check_megatron_016.sh); MLA, HybridModel and megatron.training need >= 0.19
    # (megatron_startrail/megatron/versions.py refuses them below), tested with 0.19.2.
    install_requires=["torch>=2.6", "megatron-core>=0.16.1"],
    extras_require={
        # GPU-only fused kernels; none of them is required, and none builds without CUDA.
        "gpu": ["transformer-engine", "flash-attn", "apex"],
        "test": ["pytest", "pytest-timeout"],
        "bench": ["matplotlib"],
    },
)
