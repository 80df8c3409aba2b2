import os
import sys

# Tests import helpers as ``tests.<module>``; make the repository root importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
