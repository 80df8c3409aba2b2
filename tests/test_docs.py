"""Docs and docstrings cite only what the repository holds.

Docstrings once cited design notes that were never in the repository; these checks keep
every cited Markdown file, and every cited section of docs/design.md, real.
"""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP_DIRS = {"__pycache__", "build", "dist"}
TEXT_SUFFIXES = (".py", ".md", ".sh")
MD_NAME = re.compile(r"[A-Za-z0-9_./-]*[A-Za-z0-9_-]+\.md\b")
# Markdown files that scripts write (``--out OUT`` gives OUT.md; gpu_check's table): named
# as outputs, not cited.
WRITTEN = {"OUT.md", "gpu_check.md", "gc_acc.md", "gc_fixed.md"}  # the last two: the H100 run's raw files name its outputs
DESIGN_SECTION = re.compile(r'docs/design\.md, "([^"]+)"')


def text_files():
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS
                         and not d.endswith(".egg-info"))
        for name in sorted(files):
            if name.endswith(TEXT_SUFFIXES):
                path = os.path.join(top, name)
                with open(path, encoding="utf-8", errors="replace") as f:
                    yield os.path.relpath(path, ROOT), f.read()


def test_every_cited_markdown_file_exists():
    missing = []
    for rel, text in text_files():
        here = os.path.dirname(os.path.join(ROOT, rel))
        for name in set(MD_NAME.findall(text)):
            if name.startswith("/") or os.path.basename(name) in WRITTEN:
                continue  # outside the repository, or an output file
            if not any(os.path.isfile(os.path.join(base, name)) for base in (ROOT, here)):
                missing.append(f"{rel}: {name}")
    assert not missing, f"cited but not in the repository: {missing}"


def test_cited_sections_of_the_design_notes_exist():
    with open(os.path.join(ROOT, "docs/design.md"), encoding="utf-8") as f:
        sections = {line[3:].strip() for line in f if line.startswith("## ")}
    cited = {(rel, s) for rel, text in text_files() for s in DESIGN_SECTION.findall(text)}
    assert cited, "nothing cites a section of docs/design.md: has the citation form changed?"
    assert not [c for c in cited if c[1] not in sections], f"no such section; sections: {sorted(sections)}"


def test_readme_links_the_design_notes():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        assert "](docs/design.md)" in f.read()


# -- links and commands of the Markdown docs ------------------------------------------------

LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"```[a-z]*\n(.*?)```", re.S)
# What a docs command runs; scripts/run_main_job.sh passes its extra flags to the example.
SCRIPT = re.compile(r"(examples/[\w/]+\.py|benchmarks/[\w/]+\.py|scripts/run_main_job\.sh|"
                    r"-m megatron_startrail\.planning(?:\.dynamic_cp)?)")
FLAG = re.compile(r"(?<![\w-])--[a-z0-9][a-z0-9-]*")


def markdown_docs():
    """The Markdown a reader follows (not the result files benchmarks write)."""
    for rel, text in text_files():
        if rel.endswith(".md") and "results" not in rel.split(os.sep):
            yield rel, text


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: str) -> set[str]:
    with open(path, encoding="utf-8") as f:
        return {github_anchor(line.lstrip("#")) for line in f if line.startswith("#")}


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for rel, text in markdown_docs():
        here = os.path.dirname(os.path.join(ROOT, rel))
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: outside the repository
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(here, path)) if path else os.path.join(ROOT, rel)
            if not os.path.exists(full):
                broken.append(f"{rel}: {target} (no such file)")
            elif anchor and full.endswith(".md") and anchor not in anchors(full):
                broken.append(f"{rel}: {target} (no such heading)")
    assert not broken, broken


# Prints each script's ``--help``, all in one process (torch and Megatron imported once):
# argv[1:] are the scripts, a line "=== script" before each help text.
HELP_ALL = """
import contextlib, io, runpy, sys
for script in sys.argv[1:]:
    target = "examples/pretrain_gpt.py" if script == "scripts/run_main_job.sh" else script
    sys.argv = [target, "--help"]
    text = io.StringIO()
    try:
        with contextlib.redirect_stdout(text):
            if target.startswith("-m "):
                runpy.run_module(target[3:], run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(target, run_name="__main__")
    except SystemExit as stop:
        assert stop.code in (0, None), (script, stop.code)
    print("=== " + script)
    print(text.getvalue())
"""


def _accepted_flags(scripts: list[str]) -> dict[str, set[str]]:
    """Every option of each script's own parser, read from its ``--help``."""
    proc = subprocess.run([sys.executable, "-c", HELP_ALL, *scripts], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    helps = dict(part.split("\n", 1) for part in proc.stdout.split("=== ")[1:])
    assert sorted(helps) == sorted(scripts), sorted(helps)
    return {script: set(FLAG.findall(text)) for script, text in helps.items()}


def test_every_flag_in_a_docs_command_is_accepted_by_its_parser():
    """A command shown in the docs (README, docs/, benchmarks/) runs as shown: each --flag after
    the script is one the script's parser knows (for the example: Megatron's and StarTrail's)."""
    commands = []
    for rel, text in markdown_docs():
        for block in FENCE.findall(text):
            for line in block.replace("\\\n", " ").splitlines():
                found = SCRIPT.search(line)
                if found:
                    commands.append((rel, found.group(1), FLAG.findall(line[found.end():])))
    scripts = {script for _, script, _ in commands}
    assert "examples/pretrain_gpt.py" in scripts, "the README's GPU command is no longer found"
    accepted = _accepted_flags(sorted(scripts))
    unknown = [f"{rel}: {script} {flag}" for rel, script, flags in commands for flag in flags
               if flag not in accepted[script]]
    assert not unknown, unknown
