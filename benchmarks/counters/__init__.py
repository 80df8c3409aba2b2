"""Counters of one rank's work per layer: kernel launches (``launch_budget``), non-kernel bytes
(``layer_traffic``), memory (``peak_memory``, ``fake_cuda_memory``; ``memory`` measures), and every
rank's program at scale (``scale_replay``: communicators, hangs)."""
