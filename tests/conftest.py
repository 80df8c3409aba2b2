import os
import sys

# Tests import helpers as ``tests.<module>``; make the repository root importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The whole suite runs in NCCL-rules mode (megatron_startrail/nccl_rules.py): gloo then
# obeys and is checked against what NCCL requires. STARTRAIL_CHECK_NCCL_RULES=0 turns it off.
os.environ.setdefault("STARTRAIL_CHECK_NCCL_RULES", "1")
