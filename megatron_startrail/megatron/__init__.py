"""StarTrail inside Megatron: flags, groups in Megatron's grid, core attention, layer spec.

    from megatron_startrail.megatron.arguments import add_startrail_args, validate_startrail_args
    from megatron_startrail.megatron.from_args import startrail_spec_from_args

    args = parse_args(extra_args_provider=add_startrail_args)     # megatron.training's parser
    validate_startrail_args(args)                                 # errors name the flag to change
    parallel_state.initialize_model_parallel(...)                 # Megatron's grid, as usual
    spec = startrail_spec_from_args(get_gpt_layer_local_spec(), args)  # or the Transformer Engine spec

Modules:

- ``arguments``      ``--context-parallel-algo``, ``--startrail-team-size``, ``--ulysses-degree-in-cp``
- ``parallel_state`` every CP group's ranks (pure), then the StarTrail groups inside each
- ``core_attention`` ``StarTrailCoreAttention``: Megatron's core-attention signatures
- ``layer_specs``    a GPT layer / block spec with StarTrail core attention
- ``from_args``      every StarTrail flag applied to a layer spec (the example and patches/ call it)
- ``training_log``   tokens/s on ``megatron.training``'s iteration lines
- ``rank_output``    start-up output once, not once per rank: warnings, a bad flag's error line
- ``cpu_patches``    megatron-core on a CPU-only PyTorch (never used when a GPU is present)

Nothing is imported here, so that ``cpu_patches.install_import_shims()`` can run before
the first ``import megatron``.
"""
