"""The Megatron-LM patch: well formed, and what it imports exists (offline; CI has no network).

With MEGATRON_LM pointing at a Megatron-LM checkout, also `git apply --check` at the
patch's commit (see patches/README.md for the CPU training check that was run).
"""

import importlib
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATCH = os.path.join(ROOT, "patches", "megatron-lm-core_v0.19.0-startrail.patch")
COMMIT = "5be9626709af2722333bf54797c954c09edeada3"


def patch_text():
    with open(PATCH) as f:
        return f.read()


def test_patch_touches_only_pretrain_gpt_and_hunks_add_up():
    text = patch_text()
    assert re.findall(r"^diff --git a/(\S+) b/", text, re.M) == ["pretrain_gpt.py"]
    for m in re.finditer(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@", text, re.M):
        old, new = int(m.group(1) or 1), int(m.group(2) or 1)
        body = text[m.end():].split("\n@@", 1)[0].split("\ndiff --git", 1)[0].splitlines()[1:]
        assert sum(not l.startswith("+") for l in body) == old
        assert sum(not l.startswith("-") for l in body) == new


def test_every_name_the_patch_imports_from_the_project_exists():
    imports = re.findall(r"^\+from (megatron_startrail\S*) import (.+)$", patch_text(), re.M)
    assert imports
    for module, names in imports:
        mod = importlib.import_module(module) if "megatron." not in module else None
        if mod is None:  # the Megatron-facing modules need the import shims first
            from megatron_startrail.megatron import cpu_patches

            cpu_patches.install_import_shims()
            mod = importlib.import_module(module)
        for name in (n.strip() for n in names.split(",")):
            assert hasattr(mod, name), f"{module}.{name}"


@pytest.mark.skipif("MEGATRON_LM" not in os.environ, reason="set MEGATRON_LM to a Megatron-LM checkout")
def test_patch_applies_to_its_commit():
    checkout = os.environ["MEGATRON_LM"]
    head = subprocess.run(["git", "-C", checkout, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    if head != COMMIT:
        pytest.skip(f"{checkout} is at {head}, the patch is for {COMMIT}")
    res = subprocess.run(["git", "-C", checkout, "apply", "--check", PATCH], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
