"""The project's benchmarks, one package per purpose (benchmarks/README.md); each command is a
module run from the repository root as ``python -m benchmarks.<family>.<tool>``."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
RESULTS = os.path.join(ROOT, "benchmarks", "results")  # every committed result, whatever the family
