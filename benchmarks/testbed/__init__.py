"""The emulated multi-node cluster (network namespaces, shaped links) and what runs on it: the
peer table (``cluster_bench``; ``attention_worker`` is one rank), calibration, the planner's preset
and its validation (``planner_validation``, ``compare_runs``): README.md here."""
