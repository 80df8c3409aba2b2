"""Planning tools, apart from the runtime: the planner (team size, transfer and backward
rotation per cluster and shape), the cluster presets it prices, and the memory model.

The attention never imports this package; Megatron's argument validation imports it only
where ``--startrail-team-size auto`` or ``--startrail-memory-limit-gb`` asks for it.
Command line: ``python -m megatron_startrail.planning --help``.
"""
