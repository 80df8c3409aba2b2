"""The planner checked away from the test bed: ``paper_clusters`` (the StarTrail paper's clusters,
H100 nodes)."""
