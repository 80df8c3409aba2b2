"""Hybrid (dynamic) CP: ``bench`` on the emulated cluster (``worker`` is one rank), ``schedules``
offline (Megatron's scheduler with and without StarTrail's aligned fill)."""
