"""``python -m megatron_startrail.planning``: the planner's command line."""

from .planner import main

main()
