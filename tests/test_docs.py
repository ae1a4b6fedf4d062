"""The docs are references to this repository as it is: what they link, the files and paths they
name, the options and environment variables they show and the README's quick-start commands all
exist today.

Pages: README.md and docs/*.md. A fenced block's lines are checked like prose, except a
benchmark's printed header (``# ...`` inside a fence of docs/benchmarks.md), which records the
command line its run had.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
from functools import cache
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.timeout(60)

README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"#{1,6} (.+)")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", flags=re.S | re.M)

SYSTEM_ROOTS = {"dev", "proc", "sys", "tmp", "usr", "etc", "var", "run", "mnt", "opt", "bin"}
"""Absolute paths a page may name: the machine's own, or an example mount point."""
NOT_FILES = {"metrics", "elasticft"}
"""Absolute-looking names that are no file: the metrics endpoint's URL path, the etcd key root."""
ABSOLUTE = re.compile(r"(?<![\w.:/~$}>)\]…-])/([A-Za-z_][\w.-]*)")
FILE_NAME = re.compile(r"`([\w./-]+\.(?:py|md|sh|json|ya?ml|toml|txt|c|h|png))(?:::\w+)?`")

OTHER_TOOLS_FLAGS = {
    "--ipc",  # docker run
    "--no-deps",  # pip install
    "--signal", "--requeue", "--time", "--ntasks-per-node",  # sbatch, srun
    "--log-line-prefix-template",  # torchrun of releases newer than this environment's torch
    "--override", "--debug", "--training", "--parallelism",  # torchtitan.train (--section.key)
}
OPTION_ABBREVIATIONS = {"--ckpt", "--plan", "--log", "--nproc-per", "--re"}
"""Words docs/launcher.md names as abbreviations of the launcher's options (how they read before
the script and after it); each must still abbreviate one."""
SCRIPT_DIRS = ("bench/", "examples/", "scripts/", "elasticft/", ".ci/")
"""Where the repository's own command-line scripts live (tests are no documented command)."""
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9]*(?:-[a-z0-9]+)*)(?![\w*-])")


def prose_and_code(page: Path) -> str:
    """The page's text, less what a benchmark printed about the run that produced it."""
    text = page.read_text()
    if page.name != "benchmarks.md":
        return text
    return FENCE.sub(lambda m: "\n".join(
        line for line in m.group(0).splitlines() if not line.startswith("# ")), text)


def relative_links(page: Path, *, anchors: bool = False) -> list[str]:
    """The page's links to files of this repository (with their ``#anchor`` if asked)."""
    targets = (m.group(1) if anchors else m.group(1).split("#")[0]
               for m in LINK.finditer(page.read_text()))
    return [t for t in targets if t and "://" not in t and not t.startswith("mailto:")]


def heading_anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces
    made hyphens, a repeated heading numbered."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        match = None if in_code else HEADING.fullmatch(line)
        if match is None:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


@cache
def tracked_files() -> frozenset[str]:
    """The repository's files: git's list, or outside a git checkout (an unpacked archive) the
    tree less what the setup and the runs make."""
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode == 0:
        return frozenset(listed.stdout.split())
    made = {".git", ".venv", "build", "elasticft-runs", "__pycache__", ".pytest_cache"}
    return frozenset(p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*")
                     if p.is_file() and not made & set(p.relative_to(ROOT).parts))


def names_a_file_of_the_repository(name: str, page: Path) -> bool:
    """``name`` as a page writes it: a path from the root or the page, a path inside the
    package (``agent/agent.py``), or a bare file name, of a file the repository has."""
    files = tracked_files()
    if "/" not in name:
        return any(f.rsplit("/", 1)[-1] == name for f in files)
    from_page = (page.parent / name).resolve()
    return (name in files or (from_page.is_relative_to(ROOT)
            and from_page.relative_to(ROOT).as_posix() in files)
            or any(f.endswith("/" + name) for f in files))


def test_every_relative_link_resolves() -> None:
    broken = [f"{page.relative_to(ROOT)} -> {target}" for page in PAGES
              for target in relative_links(page)
              if not (page.parent / target).resolve().exists()
              or not (page.parent / target).resolve().is_relative_to(ROOT)]
    assert not broken, f"links to missing files or out of the repository: {broken}"


def test_every_link_to_a_section_names_a_heading_of_its_page() -> None:
    broken = []
    for page in PAGES:
        for link in relative_links(page, anchors=True):
            target, _, anchor = link.partition("#")
            path = (page.parent / target).resolve() if target else page
            if anchor and path.suffix == ".md" and path.exists() \
                    and anchor not in heading_anchors(path):
                broken.append(f"{page.relative_to(ROOT)} -> {link}")
    assert not broken, f"links to sections that no heading has: {broken}"


def test_no_page_names_a_path_outside_the_repository() -> None:
    """A reader has the repository and their machine: an absolute path must be the machine's
    own (``/dev/shm``), and a file a page names must be one of the repository's."""
    outside = []
    for page in PAGES:
        text = prose_and_code(page)
        outside += [f"{page.name}: /{m.group(1)}" for m in ABSOLUTE.finditer(text)
                    if m.group(1) not in SYSTEM_ROOTS | NOT_FILES]
        outside += [f"{page.name}: {m.group(1)}" for m in FILE_NAME.finditer(text)
                    if not names_a_file_of_the_repository(m.group(1), page)]
    assert not outside, f"paths that are not in the repository: {outside}"


def parser_flags(parser: argparse.ArgumentParser) -> set[str]:
    flags = set()
    for action in parser._actions:
        flags.update(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                flags |= parser_flags(sub)
    return flags


@cache
def existing_flags() -> frozenset[str]:
    """Every long option of ``elasticft-run`` and each ``elasticft`` command, and of the
    repository's own scripts."""
    from elasticft import cli
    from elasticft.run import build_parser

    flags = parser_flags(build_parser())
    for command in cli.SUBCOMMANDS:
        flags |= parser_flags(cli.build_parser(command))
    for name in tracked_files():
        if name.startswith(SCRIPT_DIRS) and name.endswith((".py", ".sh")):
            source = (ROOT / name).read_text()
            flags.update(re.findall(r"""["'](--[a-z][a-z0-9-]*)["']""", source))
            flags.update(re.findall(r"^\s*(--[a-z][a-z0-9-]*)(?:=\S*)?\)", source, flags=re.M))
    return frozenset(flags)


def test_no_page_names_an_option_that_does_not_exist() -> None:
    """A removed option (``--hang-floor-s``) or a misspelt one is a doc that lies."""
    from elasticft.removed_options import REMOVED_OPTIONS

    abbreviations = {word for word in OPTION_ABBREVIATIONS
                     if any(flag.startswith(word) for flag in existing_flags())}
    known = existing_flags() | OTHER_TOOLS_FLAGS | abbreviations
    removed = {"--" + name.replace("_", "-") for name in REMOVED_OPTIONS}
    unknown = sorted({f"{page.name}: {m.group(1)}" for page in PAGES
                      for m in FLAG.finditer(prose_and_code(page))
                      if m.group(1) not in known or m.group(1) in removed})
    assert not unknown, f"options that no parser has: {unknown}"


def test_no_page_names_an_environment_variable_that_nothing_reads() -> None:
    """Every ``ELASTICFT_*`` name is an option's variable, one the agent gives its workers, or
    one a script of the repository reads (``ELASTICFT_COMPAT_TORCH``); never a removed one."""
    from elasticft.agent.agent import WORKER_ENV_NAMES
    from elasticft.options import known_env_names
    from elasticft.removed_options import REMOVED_OPTIONS

    scripts = set()
    for name in tracked_files():
        if name.startswith(SCRIPT_DIRS) and name.endswith((".py", ".sh")):
            scripts.update(re.findall(r"ELASTICFT_[A-Z0-9_]*[A-Z0-9]", (ROOT / name).read_text()))
    removed = {"ELASTICFT_" + name.upper() for name in REMOVED_OPTIONS}
    known = (known_env_names() | set(WORKER_ENV_NAMES) | scripts) - removed
    unknown = sorted({f"{page.name}: {name}" for page in PAGES
                      for name in re.findall(r"ELASTICFT_[A-Z0-9_]*[A-Z0-9]",
                                             prose_and_code(page))
                      if name not in known})
    assert not unknown, f"environment variables that nothing reads: {unknown}"


def test_the_flag_check_catches_a_removed_option() -> None:
    assert "--hang-floor-s" not in existing_flags()
    assert "--warm-start" in existing_flags() and "--no-warm-start" in existing_flags()
    assert "--rank" in existing_flags()  # elasticft chaos kill


def quick_start_commands() -> list[str]:
    """The command lines of the README's quick-start sections, continuation lines joined."""
    sections = re.split(r"^## ", README.read_text(), flags=re.M)
    commands = []
    for section in sections:
        if not section.lower().startswith("quick start"):
            continue
        for block in FENCE.findall(section):
            joined = re.sub(r"\\\n\s*", " ", block)
            commands += [line.strip() for line in joined.splitlines()
                         if line.strip() and not line.lstrip().startswith("#")]
    return commands


def test_every_quick_start_command_parses() -> None:
    from elasticft import cli, command_line
    from elasticft import options as elasticft_options
    from elasticft.run import build_parser

    commands = quick_start_commands()
    assert any(c.startswith("elasticft-run ") for c in commands), commands
    assert any(c.startswith("elasticft chaos kill ") for c in commands), commands
    for command in commands:
        argv = shlex.split(command, comments=True)
        program, args = argv[0], argv[1:]
        if program == "elasticft-run":
            parsed = command_line.parse_args(build_parser(), args)
            elasticft_options.from_namespace(parsed, {})
            script = parsed.training_script
            assert script == "train.py" or (ROOT / script).is_file(), command
        elif program == "elasticft":
            parsed = cli.build_parser(args[0]).parse_args(args)
            assert callable(parsed.handler), command
        elif program == "bash":
            assert (ROOT / args[0]).is_file(), command
        else:
            raise AssertionError(f"README quick start: `{command}` runs no command of this "
                                 "repository")


GLOSSARY = ROOT / "docs" / "glossary.md"
ABBREVIATIONS = {
    "TOR": "training overhead ratio",
    "ETTR": "effective training time ratio",
    "MTBF": "mean time between failures",
    "DCP": "torch.distributed.checkpoint",
    "MFU": "model FLOPs utilisation",
    "HPPS": None,  # the glossary only
}
"""Abbreviations a reader meets without knowing them, with the words that spell each out on a
page (None: only the glossary explains it)."""


def unexplained_abbreviations(page_name: str, text: str, glossary_terms: set[str]) -> list[str]:
    """The abbreviations of :data:`ABBREVIATIONS` that ``text`` uses without explaining them
    (pure): explained when the page spells it out, or the glossary defines it and the page
    links the glossary."""
    links_glossary = "glossary.md" in text or page_name == "glossary.md"
    return [abbr for abbr, spelled in ABBREVIATIONS.items()
            if re.search(rf"\b{abbr}\b", text)
            and not (spelled and spelled.lower() in text.lower())
            and not (links_glossary and abbr in glossary_terms)]


@pytest.mark.parametrize(("text", "unexplained"), [
    ("TOR 0.93", ["TOR"]),
    ("TOR 0.93, the Training Overhead Ratio", []),
    ("TOR 0.93 ([glossary](glossary.md))", []),
    ("HPPS's times (the [glossary](glossary.md))", []),
    ("HPPS's times", ["HPPS"]),
    ("a TORQUE cluster", []),
])
def test_the_abbreviation_check(text: str, unexplained: list[str]) -> None:
    assert unexplained_abbreviations("x.md", text, set(ABBREVIATIONS)) == unexplained


def glossary_terms() -> set[str]:
    return {m.group(1) for m in re.finditer(r"^#{2,3} (.+)$", GLOSSARY.read_text(), flags=re.M)}


def test_the_glossary_defines_every_listed_abbreviation() -> None:
    assert set(ABBREVIATIONS) <= glossary_terms()


def test_every_abbreviation_a_page_uses_is_explained_there() -> None:
    terms = glossary_terms()
    unexplained = [f"{page.name}: {abbr}" for page in PAGES
                   for abbr in unexplained_abbreviations(page.name, page.read_text(), terms)]
    assert not unexplained, (
        f"abbreviations used without being spelled out or the glossary linked: {unexplained}")


MEASUREMENT = re.compile(r"\d(?:[\d.,]*\d)?\s?(?:s|ms|µs|ns|%|x|GB|MB)\b")


def fixed_without_a_measurement(text: str) -> list[str]:
    """The clauses of ``text`` (between ``.;|()`` and line ends of a table) that say a thing
    was "since fixed" and give no figure (pure); the words in quotes are a mention."""
    return [clause.strip()[:80] for clause in re.split(r"[.;|()]\s|\n\||[()|]", text)
            if re.search(r'(?<!")since fixed(?!")', clause, flags=re.I)
            and not MEASUREMENT.search(clause)]


@pytest.mark.parametrize(("text", "flagged"), [
    ("the spare failed there, since fixed: see the run", 1),
    ("the spare failed there; since fixed, 2.3 s in the run after", 0),
    ("nothing was fixed", 0),
    ('the test fails on "since fixed" with no figure', 0),
    ("| 17.39 s | 5.35 s (the restart mode failed there, since fixed: see the run) |", 1),
])
def test_the_since_fixed_check(text: str, flagged: int) -> None:
    assert len(fixed_without_a_measurement(text)) == flagged


def test_no_page_says_since_fixed_without_a_measurement() -> None:
    claims = [f"{page.name}: {p}" for page in PAGES for p in fixed_without_a_measurement(
        page.read_text())]
    assert not claims, f'"since fixed" with no measurement beside it: {claims}'
