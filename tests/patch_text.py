"""Read patches/megatron-lm-core_v0.19.2-startrail.patch: its hunks, and the code blocks it adds
(so that tests can run the patch's own lines without a Megatron-LM checkout)."""

from __future__ import annotations

import os
import re
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATCH = os.path.join(ROOT, "patches", "megatron-lm-core_v0.19.2-startrail.patch")
HUNK = re.compile(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@.*$", re.M)


def patch_text() -> str:
    with open(PATCH) as f:
        return f.read()


def hunks(text: str | None = None) -> list[tuple[int, int, list[str]]]:
    """(old length, new length, body lines with their ' '/'+'/'-' prefix) of every hunk."""
    text = patch_text() if text is None else text
    out = []
    for m in HUNK.finditer(text):
        body = text[m.end():].split("\n@@", 1)[0].split("\ndiff --git", 1)[0].splitlines()[1:]
        out.append((int(m.group(1) or 1), int(m.group(2) or 1), body))
    return out


def added_lines(text: str | None = None) -> list[str]:
    """Every line the patch adds, without its '+'."""
    return [line[1:] for _, _, body in hunks(text) for line in body if line.startswith("+")]


def added_block(first_line: str, text: str | None = None) -> str:
    """The dedented source of the block the patch adds that starts with the line ``first_line``
    (its whole body: every line until the indentation falls back). Fails unless the patch
    adds every line of the block (so the source is the patch's, not upstream's)."""
    for _, _, body in hunks(text):
        new_side = [(line[0], line[1:]) for line in body if line[:1] in (" ", "+")]
        starts = [i for i, (_, line) in enumerate(new_side) if line.strip() == first_line]
        if not starts:
            continue
        start = starts[0]
        indent = len(new_side[start][1]) - len(new_side[start][1].lstrip())
        end = start + 1
        while end < len(new_side) and (not new_side[end][1].strip()
                                        or len(new_side[end][1]) - len(new_side[end][1].lstrip()) > indent):
            end += 1
        block = new_side[start:end]
        assert all(kind == "+" for kind, line in block if line.strip()), f"{first_line!r} is not all added lines"
        return textwrap.dedent("\n".join(line for _, line in block))
    raise AssertionError(f"the patch adds no line {first_line!r}")
