"""Reading a Dockerfile: its instructions, the shell commands of its RUNs, its pip installs, and
the directories its final USER owns.

No checks here: ``check_image`` judges what these readers find, and the compose checks use
``user_owned_dirs`` for the volumes a service may mount.
"""

from __future__ import annotations

import dataclasses
import re
import shlex

from tests.unit.compose.compose_file import flag_value

_PIP_VALUE_OPTIONS = {
    "-i",
    "--index-url",
    "--extra-index-url",
    "-f",
    "--find-links",
    "-r",
    "--requirement",
    "-c",
    "--constraint",
    "-t",
    "--target",
    "--prefix",
    "--root",
    "--platform",
    "--python-version",
    "--only-binary",
    "--no-binary",
    "--progress-bar",
    "--cache-dir",
    "--src",
    "-e",
    "--editable",
}


@dataclasses.dataclass
class PipInstall:
    requirements: list[str]
    options: set[str]
    index_url: str | None


@dataclasses.dataclass
class OwnedDirs:
    uid: str  # the final USER's uid ("" when the Dockerfile does not say it)
    dirs: set[str]  # the directories chown'd to it (its home, when useradd creates one)


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        if not pending and line.strip().startswith("#"):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        if pending and line.strip().startswith("#"):
            continue
        full = (pending + line).strip()
        pending = ""
        if full:
            word, _, rest = full.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def run_commands(text: str) -> list[list[str]]:
    """The argv of each shell command of each RUN, in order."""
    commands: list[list[str]] = []
    for instruction, rest in instructions(text):
        if instruction != "RUN":
            continue
        lexer = shlex.shlex(rest, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        commands.append([])
        for token in lexer:
            if token in ("&&", "||", ";", "|", "&"):
                commands.append([])
            else:
                commands[-1].append(token)
    return [argv for argv in commands if argv]


def user_owned_dirs(text: str) -> OwnedDirs:
    """The directories the image's final USER owns: ``chown user[:group] dir...`` to that user (by
    name or uid) and ``useradd --create-home``'s home."""
    users = [rest.split(":")[0].strip() for ins, rest in instructions(text) if ins == "USER"]
    user = users[-1] if users else "root"
    names, uid, dirs = {user}, user if user.isdigit() else "", set()
    commands = run_commands(text)
    for argv in commands:
        # the user, named by name or by uid: either way its other name counts too
        created_uid = flag_value(argv, "-u", "--uid")
        if argv[0] in ("useradd", "adduser") and user in (argv[-1], created_uid):
            names.add(argv[-1])
            uid = created_uid or uid
            if "-m" in argv or "--create-home" in argv:
                dirs.add(f"/home/{argv[-1]}")
    if uid:
        names.add(uid)
    for argv in commands:
        words = [a for a in argv[1:] if not a.startswith("-")]
        if argv[0] == "chown" and len(words) >= 2 and words[0].split(":")[0] in names:
            dirs.update(d.rstrip("/") for d in words[1:])
    return OwnedDirs(uid, dirs)


def pip_installs(text: str) -> list[PipInstall]:
    """Each ``pip install`` (or ``python -m pip install``) of the RUNs, in order."""
    installs = []
    for argv in run_commands(text):
        words = [w for w in argv if not w.startswith("-")][:4]
        if words[:2] in (["pip", "install"], ["pip3", "install"]):
            start = argv.index("install") + 1
        elif words[:1] and words[0].startswith("python") and argv[1:4] == ["-m", "pip", "install"]:
            start = 4
        else:
            continue
        installs.append(_pip_install(argv[start:]))
    return installs


def _pip_install(argv: list[str]) -> PipInstall:
    """The requirements and options of the words after ``install``."""
    reqs, options, index_url = [], set(), None
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if arg.startswith("-"):
            options.add(name if eq else arg)
            if not eq and arg in _PIP_VALUE_OPTIONS:
                i += 1
                value = argv[i] if i < len(argv) else ""
            if (name if eq else arg) in ("-i", "--index-url"):
                index_url = value
        else:
            reqs.append(arg)
        i += 1
    return PipInstall(reqs, options, index_url)


def req_name(req: str) -> str:
    """A requirement's normalized project name (``Foo_Bar>=1`` -> ``foo-bar``)."""
    m = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", req)
    return re.sub(r"[-_.]+", "-", m.group(0)).lower() if m else ""


def is_project(req: str) -> bool:
    return req.startswith((".", "/")) or req_name(req) == "deepinfer"
