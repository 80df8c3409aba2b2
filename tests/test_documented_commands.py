"""Every command the docs, the result files and the module docstrings show runs as written.

Collected from README.md, every Markdown file outside ``benchmarks/results/`` subfolders (docs/,
the READMEs), ``benchmarks/results/*.md`` and every Python module's docstring: ``python -m MODULE
...``, ``python path/to/script.py ...`` (also ``.venv/bin/python``, under ``sudo``), ``torchrun ...
script.py ...`` and ``bash path/to/script.sh ...``. For each:

- what it names exists: the module or script in this repository (``python -m pytest`` and other
  tools from outside are left to their makers);
- a ``python path.py`` command names no script that imports a package of the repository root
  other than the installed one (``benchmarks``, ``tests``, ...): the script's own folder on
  ``sys.path`` does not hold it (the layer-traffic counter, run by its path, once ended in
  ``No module named 'benchmarks'``); such a command is ``python -m package.module``;
- its ``--help`` exits 0, run by this test's own interpreter with the repository on PYTHONPATH,
  all targets in one process (torch and Megatron imported once), each as Python would run it
  (``-m``: the working directory first on ``sys.path``; a path: the script's folder);
- every ``--flag`` it shows is one its parser knows (a shell script: the flags of the program its
  ``"$@"`` goes to, or one the script reads itself);
- a shell script parses (``bash -n``); it is not run: most build a virtual environment first.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP_DIRS = {"__pycache__", "build", "dist"}
RESULTS = os.path.join("benchmarks", "results")
PROJECT = {"benchmarks", "examples", "megatron_startrail", "patches", "scripts", "tests"}

PYTHON = r"(?:sudo\s+)?(?:[\w./$-]*/)?python3?\s+(?P<py>-m\s+[\w.]+|[\w./-]+\.py)"
TORCHRUN = r"torchrun(?:\s+--?[\w-]+(?:[\s=][\w.:-]+)?)*\s+(?P<run>[\w./-]+\.py)"
BASH = r"bash\s+(?P<sh>[\w./-]+\.sh)"
# A command and its arguments: to the end of the line, a closing backtick, a table cell or a comment.
COMMAND = re.compile(rf"(?<![\w/.-])(?:{PYTHON}|{TORCHRUN}|{BASH})(?P<args>[^`\n|;#]*)")
FLAG = re.compile(r"(?<![\w-])--[a-z0-9][a-z0-9-]*")
# Commands whose module has no parser: ``__main__`` runs the whole table, so --help is not cheap.
NO_HELP = {
    "-m tests.megatron.test_gpt_gradients": "prints docs/composition.md's table",
    "-m tests.megatron.test_gpt_sinks": "prints docs/sliding-windows.md's table",
    "patches/run_on_cpu.py": "runs a Megatron-LM checkout's pretrain_gpt.py (MEGATRON_LM)",
}


def _sources():
    """(file, text) of every place a reader finds commands: Markdown, and module docstrings."""
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS
                         and not d.endswith(".egg-info"))
        for name in sorted(files):
            path = os.path.join(top, name)
            rel = os.path.relpath(path, ROOT)
            if name.endswith(".md"):
                if rel.startswith(RESULTS + os.sep) and os.path.dirname(rel) != RESULTS:
                    continue  # a lent GPU's records, as the device wrote them (the command it ran then)
                with open(path, encoding="utf-8") as f:
                    yield rel, f.read()
            elif name.endswith(".py"):
                with open(path, encoding="utf-8") as f:
                    doc = ast.get_docstring(ast.parse(f.read()), clean=False)
                if doc:
                    yield rel, doc


@functools.cache
def documented_commands() -> list[tuple[str, str, list[str]]]:
    """(where, target, its flags): target is ``-m MODULE``, ``path.py`` or ``path.sh``."""
    found = []
    for rel, text in _sources():
        for m in COMMAND.finditer(text.replace("\\\n", " ")):
            target = " ".join((m["py"] or m["run"] or m["sh"]).split())
            if target.endswith("."):
                continue  # a placeholder: ``python -m benchmarks.<family>.<tool>``
            found.append((rel, target, FLAG.findall(m["args"])))
    return found


def _in_project(target: str) -> bool:
    name = target[3:] if target.startswith("-m ") else target
    return re.split(r"[./]", name, maxsplit=1)[0] in PROJECT


def _module_file(module: str) -> str | None:
    base = os.path.join(ROOT, *module.split("."))
    for path in (base + ".py", os.path.join(base, "__main__.py")):
        if os.path.isfile(path):
            return path
    return None


def _forwarded_to(script: str, seen=()) -> str | None:
    """Where a shell script's ``"$@"`` goes: ``-m MODULE``, a Python script, or another shell
    script's target; None where it goes nowhere."""
    with open(os.path.join(ROOT, script), encoding="utf-8") as f:
        text = f.read().replace("\\\n", " ").replace("$ROOT/", "")  # paths from the repository root
    for line in text.splitlines():
        if '"$@"' not in line or line.lstrip().startswith("#"):
            continue
        if m := re.search(r"-m\s+([\w.]+)", line):
            return "-m " + m[1]
        if m := re.search(r"([\w-]+/[\w/.-]*\.py)\b", line):
            return m[1]
        if (m := re.search(r"([\w-]+/[\w/.-]*\.sh)\b", line)) and m[1] not in seen:
            return _forwarded_to(m[1], (*seen, script))
    return None


# Prints each target's ``--help`` in one process, as JSON lines {"target", "code", "help"}.
HELP_ALL = """
import contextlib, io, json, os, runpy, sys, time
root = os.getcwd()
for target in sys.argv[1:]:
    text = io.StringIO()
    code, start = 0, time.perf_counter()
    path = list(sys.path)
    try:
        with contextlib.redirect_stdout(text):
            if target.startswith("-m "):
                sys.argv = [target[3:], "--help"]
                sys.path[0] = root  # python -m: the working directory first
                runpy.run_module(target[3:], run_name="__main__", alter_sys=True)
            else:
                sys.argv = [target, "--help"]
                sys.path[0] = os.path.dirname(os.path.abspath(target))  # python path.py: its folder
                runpy.run_path(target, run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException as error:
        code, text = 1, io.StringIO(f"{type(error).__name__}: {error}")
    finally:
        sys.path[:] = path
    print("\\x1e" + json.dumps({"target": target, "code": code, "help": text.getvalue(),
                                 "seconds": time.perf_counter() - start}), flush=True)
"""


def _helps(targets: list[str]) -> dict[str, dict]:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", HELP_ALL, *targets], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)
    rows = [json.loads(part) for part in proc.stdout.split("\x1e")[1:]]
    assert [r["target"] for r in rows] == targets, (proc.returncode, proc.stderr[-3000:])
    return {r["target"]: r for r in rows}


def test_the_collector_finds_each_kind_of_command():
    """The patterns still see what the docs show (a silent miss would pass everything)."""
    targets = {target for _, target, _ in documented_commands()}
    for kind in ("examples/pretrain_gpt.py", "scripts/run_tests.sh", "scripts/gpu_session.sh",
                 "-m benchmarks.counters.layer_traffic", "-m benchmarks.testbed.cluster_bench",
                 "-m megatron_startrail.planning", "scripts/mutation_check.py"):
        assert kind in targets, (kind, sorted(targets))
    assert _forwarded_to("scripts/run_main_job.sh") == "examples/pretrain_gpt.py"
    assert _forwarded_to("scripts/compare_losses.sh") == "examples/pretrain_gpt.py"
    assert _forwarded_to("scripts/gpu_check.sh") == "-m benchmarks.gpu.check"


def test_a_script_inside_a_package_is_refused():
    """What this test once let pass: the file exists and --help works with the repository on
    PYTHONPATH, but the command as written fails."""
    assert _problem("benchmarks/counters/layer_traffic.py") == (
        "imports benchmarks from the repository root, which python benchmarks/counters/layer_traffic.py does not "
        "put on sys.path: run it as python -m benchmarks.counters.layer_traffic")
    assert _problem("examples/comm_volume.py") is None  # megatron_startrail is installed
    assert _problem("-m benchmarks.layer_traffic") == "no module benchmarks.layer_traffic in the repository"
    assert _problem("-m benchmarks.counters.layer_traffic") is None


def _problem(target: str) -> str | None:
    """Why ``target`` cannot run as written, before running it; None where it can."""
    if target.startswith("-m "):
        return None if _module_file(target[3:]) else f"no module {target[3:]} in the repository"
    if not os.path.isfile(os.path.join(ROOT, target)):
        return f"no file {target}"
    if target.endswith(".py") and (names := sorted(_repository_imports(target))):
        return (f"imports {', '.join(names)} from the repository root, which python {target} does not put on "
                f"sys.path: run it as python -m {target[:-3].replace('/', '.')}")
    return None


def _repository_imports(script: str) -> set[str]:
    """The packages of the repository root (not installed: setup.py installs megatron_startrail
    alone) that ``script`` imports by their absolute name, anywhere in it."""
    local = {d for d in os.listdir(ROOT) if os.path.isfile(os.path.join(ROOT, d, "__init__.py"))}
    local.discard("megatron_startrail")
    with open(os.path.join(ROOT, script), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    names |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and not node.level}
    return {name.split(".")[0] for name in names} & local


def test_every_documented_command_runs_as_written():
    commands = [(rel, target, flags) for rel, target, flags in documented_commands() if _in_project(target)]
    problems = sorted({f"{rel}: {target}: {why}" for rel, target, _ in commands if (why := _problem(target))})
    assert not problems, problems

    scripts = sorted({target for _, target, _ in commands if target.endswith(".sh")})
    syntax = subprocess.run(["bash", "-c", 'for s; do bash -n "$s" || echo "$s"; done', "-", *scripts], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert not syntax.stdout and syntax.returncode == 0, syntax.stdout + syntax.stderr

    forwards = {script: _forwarded_to(script) for script in scripts}
    runnable = {target for _, target, _ in commands if not target.endswith(".sh")} | set(forwards.values())
    runnable = sorted(t for t in runnable if t and _in_project(t) and t not in NO_HELP)
    helps = _helps(runnable)
    failed = [f"{t}: exit {r['code']}: {r['help'][-500:]}" for t, r in helps.items() if r["code"] != 0]
    assert not failed, failed

    def accepted(target: str) -> set[str] | None:  # None: a program from outside, its flags not checked
        if target.endswith(".sh"):
            with open(os.path.join(ROOT, target), encoding="utf-8") as f:
                own = set(FLAG.findall(f.read()))
            forward = forwards[target]
            if forward is None:
                return own
            theirs = accepted(forward) if _in_project(forward) else None
            return None if theirs is None else own | theirs
        return set(FLAG.findall(helps[target]["help"])) if target in helps else None

    unknown = sorted({f"{rel}: {target} {flag}" for rel, target, flags in commands
                      if (known := accepted(target)) is not None for flag in flags if flag not in known})
    assert not unknown, unknown
