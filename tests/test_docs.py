"""Docs and docstrings cite only what the repository holds.

Docstrings once cited design notes that were never in the repository; these checks keep
every cited Markdown file, and every cited section of docs/design.md, real.
"""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP_DIRS = {"__pycache__", "build", "dist"}
TEXT_SUFFIXES = (".py", ".md", ".sh")
MD_NAME = re.compile(r"[A-Za-z0-9_./-]*[A-Za-z0-9_-]+\.md\b")
# Markdown files that scripts write (``--out OUT`` gives OUT.md; gpu_check's table): named
# as outputs, not cited.
WRITTEN = {"OUT.md", "gpu_check.md", "gpu_session.md"}
# A lent GPU's results, committed as the device wrote them (they name its $OUT files).
RAW_GPU_RESULTS = os.path.join("benchmarks", "results", "gpu") + os.sep
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
            if name.startswith("/") or os.path.basename(name) in WRITTEN or rel.startswith(RAW_GPU_RESULTS):
                continue  # outside the repository, an output file, or a device's output as it wrote it
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


# -- links of the Markdown docs (their commands: tests/test_documented_commands.py) ------------------------------------------------

LINK = re.compile(r"\]\(([^)\s]+)\)")


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
