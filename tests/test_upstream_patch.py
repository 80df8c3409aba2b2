"""The Megatron-LM patch (offline; CI has no network and no registry ships Megatron-LM's
pretrain_gpt.py -- neither the megatron-core wheel nor its sdist): well formed, what it
imports exists, and StarTrail reaches the model only through the function the example uses
too (``startrail_spec_from_args``), so a flag cannot reach one and not the other.
tests/megatron/test_spec_from_args.py runs the patch's own lines on 4 ranks.

With MEGATRON_LM pointing at a Megatron-LM checkout, also `git apply --check` at one of the
commits the patch targets (see patches/README.md for the CPU training check that was run).
"""

import ast
import importlib
import os
import re
import subprocess

import pytest

from tests.patch_text import PATCH, ROOT, added_lines, hunks, patch_text

# Megatron-LM commits whose pretrain_gpt.py is the one the patch was made against (the same
# file at both): the core_r0.19.0 release branch head, whose megatron/training is the
# megatron-core 0.19.2 wheel's, and the core_v0.19.0 tag.
COMMITS = ("f8837c04ef6cbef6cdefb8de001aad63178aebbf", "5be9626709af2722333bf54797c954c09edeada3")
# What the patch may use from the project: the flags, their validation, and the one function
# that applies every flag to the layer spec.
PATCH_API = {"add_startrail_args", "validate_startrail_args", "startrail_spec_from_args"}


def test_patch_touches_only_pretrain_gpt_and_hunks_add_up():
    text = patch_text()
    assert re.findall(r"^diff --git a/(\S+) b/", text, re.M) == ["pretrain_gpt.py"]
    assert hunks(text)
    for old, new, body in hunks(text):
        assert sum(not line.startswith("+") for line in body) == old
        assert sum(not line.startswith("-") for line in body) == new


def project_imports(lines):
    return re.findall(r"^from (megatron_startrail\S*) import (.+)$", "\n".join(lines), re.M)


def test_every_name_the_patch_imports_from_the_project_exists():
    imports = project_imports(added_lines())
    assert imports
    from megatron_startrail.megatron import cpu_patches

    cpu_patches.install_import_shims()  # the Megatron-facing modules import megatron.core
    for module, names in imports:
        mod = importlib.import_module(module)
        for name in (n.strip() for n in names.split(",")):
            assert hasattr(mod, name), f"{module}.{name}"


def test_the_patch_uses_only_the_flags_and_the_shared_spec_function():
    lines = added_lines()
    imported = {n.strip() for _, names in project_imports(lines) for n in names.split(",")}
    assert imported == PATCH_API
    code = "\n".join(line for line in lines if not line.lstrip().startswith(("from ", "import ", "#")))
    # Each is called, and no StarTrail flag is read in the patch itself (the function reads them).
    for name in PATCH_API:
        assert re.search(rf"\b{name}\(", code), name
    assert not re.findall(r"args\.(startrail_\w+|ulysses_\w+)", code)


def calls_in(path):
    with open(path) as f:
        tree = ast.parse(f.read())
    return {node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            for node in ast.walk(tree) if isinstance(node, ast.Call)}


def test_the_example_builds_its_spec_with_the_same_function():
    calls = calls_in(os.path.join(ROOT, "examples", "pretrain_gpt.py"))
    assert "startrail_spec_from_args" in calls
    # Nothing that would let it configure StarTrail past the shared function.
    assert not calls & {"to_startrail_spec", "initialize_startrail", "new_startrail_groups", "startrail_core_attention"}


# Flags that change nothing once validate_startrail_args has turned them into other flags.
RESOLVED_BY_VALIDATION = {"startrail_memory_limit_gb"}  # -> --startrail-team-size / --startrail-regather-in-backward


def test_every_startrail_flag_is_read_by_the_shared_function():
    import argparse

    from megatron_startrail.megatron.arguments import add_startrail_args

    parser = add_startrail_args(argparse.ArgumentParser())
    flags = {a.dest for a in parser._actions if a.dest != "help"}
    with open(os.path.join(ROOT, "megatron_startrail", "megatron", "from_args.py")) as f:
        read = set(re.findall(r"args\.(\w+)", f.read()))
    # A new flag fails here until from_args.py applies it (or it is listed above, with why).
    assert flags - RESOLVED_BY_VALIDATION <= read, sorted(flags - RESOLVED_BY_VALIDATION - read)


@pytest.mark.skipif("MEGATRON_LM" not in os.environ, reason="set MEGATRON_LM to a Megatron-LM checkout")
def test_patch_applies_to_its_commit():
    checkout = os.environ["MEGATRON_LM"]
    head = subprocess.run(["git", "-C", checkout, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    if head not in COMMITS:
        pytest.skip(f"{checkout} is at {head}, the patch is for {COMMITS}")
    res = subprocess.run(["git", "-C", checkout, "apply", "--check", PATCH], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
