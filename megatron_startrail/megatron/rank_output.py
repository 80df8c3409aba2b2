"""What the ranks of a launch print at start-up: each warning once, a bad flag's error once.

Every rank of ``torchrun`` imports Megatron and parses the same command line, so without
this a CPU run of 8 ranks repeats every import-time warning 8 times, and a mistyped flag
prints argparse's usage (about 700 lines of Megatron flags) once per rank, with the one
useful line buried at the end of each copy. Before torch.distributed exists the rank is
only known from the launcher's ``RANK`` variable, so that is what is read here.

    quiet_repeated_warnings()               # before the first ``import megatron``
    parser.error = raise_flag_error          # in the extra_args_provider: no usage dump
    with bad_flags_reported_once():          # the entry point's parse + validation
        args = parse_arguments()
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings

# How long a rank other than 0 waits before exiting on a bad flag. Launchers (torchrun,
# srun --kill-on-bad-exit) stop the other ranks as soon as one exits, so the rank that exits
# first decides what gets printed: giving rank 0 this head start makes it that one. Ranks
# run the same imports, so they reach the parser within seconds of each other on an idle
# host; on a loaded one they do not: in a full test run on 2 busy cores, rank 0 of
# tests/megatron/test_example_failures.py's torchrun got there more than 20 s after rank 1
# (this was 20 s; both printed). The wait costs nothing when rank 0 gets there first.
OTHER_RANKS_GRACE_S = 60.0


def launch_rank() -> int:
    """This process's global rank as the launcher set it (0 when not launched as a rank)."""
    return int(os.environ.get("RANK", "0"))


def quiet_repeated_warnings() -> None:
    """Show Python warnings on rank 0 only (the same filter Megatron-LM's pretrain_gpt.py
    installs): Megatron and torch warn at import time, identically on every rank."""
    if launch_rank() != 0:
        for category in (UserWarning, FutureWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", category=category)


class FlagError(ValueError):
    """A command-line flag argparse rejected (unknown flag, invalid choice, bad value)."""


def raise_flag_error(message: str):
    """``parser.error`` that raises instead of printing the usage and exiting, so the caller
    decides who prints (see :func:`bad_flags_reported_once`)."""
    raise FlagError(message)


@contextlib.contextmanager
def bad_flags_reported_once(prog: str | None = None):
    """Turn a bad flag (argparse's, or a ValueError / AssertionError of the flag validation)
    into one line on stderr from rank 0 and exit status 2 on every rank.

    Use around parsing and validation only: every rank raises the same error there. Ranks
    other than 0 print nothing unless they are still running after the grace period (a
    launcher that does not stop them, or a rank 0 that never got there), then they print the
    line too, with their rank, so that the error is never lost.
    """
    prog = prog or os.path.basename(sys.argv[0])
    try:
        yield
    except (ValueError, AssertionError) as e:
        message = str(e) or type(e).__name__
        rank = launch_rank()
        if rank != 0:
            time.sleep(OTHER_RANKS_GRACE_S)
            prog = f"{prog} [rank {rank}]"
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)
