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
WRITTEN = {"OUT.md", "gpu_check.md"}
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
