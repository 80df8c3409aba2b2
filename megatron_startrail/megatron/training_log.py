"""Tokens per second on ``megatron.training``'s iteration log line.

Megatron's ``training_log`` reports the time per iteration and the global batch size,
but not the token throughput, which is what context parallelism changes. The figure is
derived from the line itself, so it is exactly consistent with what Megatron printed::

    iteration 5/30 | ... elapsed time per iteration (ms): 420.0 | global batch size: 4 | ...
    -> ... | tokens/s: 19504.8 |          (4 sequences x 2048 tokens / 0.420 s)
"""

from __future__ import annotations

import functools
import re

_ELAPSED_MS = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")
_BATCH = re.compile(r"global batch size: +([0-9]+)")


def with_tokens_per_second(line: str, seq_length: int) -> str:
    """``line`` plus `` tokens/s: X |`` if it is an iteration log line; otherwise unchanged."""
    elapsed, batch = _ELAPSED_MS.search(line), _BATCH.search(line)
    if not (elapsed and batch) or float(elapsed.group(1)) <= 0.0:
        return line
    tokens_per_s = int(batch.group(1)) * seq_length / (float(elapsed.group(1)) / 1000.0)
    return f"{line.rstrip()} tokens/s: {tokens_per_s:.1f} |"


def log_tokens_per_second(seq_length: int) -> None:
    """Make ``megatron.training``'s iteration lines end with tokens/s (idempotent)."""
    from megatron.training import training  # noqa: PLC0415

    printer = training.print_rank_last
    if getattr(printer, "_adds_tokens_per_second", False):
        return

    @functools.wraps(printer)
    def print_with_tokens_per_second(message):
        printer(with_tokens_per_second(message, seq_length) if isinstance(message, str) else message)

    print_with_tokens_per_second._adds_tokens_per_second = True
    training.print_rank_last = print_with_tokens_per_second
