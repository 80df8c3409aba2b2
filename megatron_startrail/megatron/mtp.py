"""Multi-token prediction (``--mtp-num-layers``) under StarTrail CP: the one installer.

Two replacements make MTP train as at CP = 1, and they belong together: the roll
(mtp_roll.py: ``roll_tensor``, the CP group's mean count, packed documents) and the loss
(mtp_loss.py: ``process_mtp_loss``, which hands the roll stand-in masks). The loss uses the
roll's helpers, so the installer that needs both sits above them both; neither imports the
other's installer.
"""

from __future__ import annotations

from .mtp_loss import install_startrail_mtp_loss
from .mtp_roll import install_startrail_mtp_roll


def install_startrail_mtp() -> None:
    """Replace megatron-core's ``multi_token_prediction.roll_tensor`` with the package's roll
    and its ``process_mtp_loss`` (where GPTModel and HybridModel call it) with the package's
    loss; Megatron's own are kept beside them and still run at CP = 1 (idempotent). Called
    when StarTrail's groups are built for a model with MTP (from_args.py, the Bridge spec)."""
    install_startrail_mtp_roll()
    install_startrail_mtp_loss()
