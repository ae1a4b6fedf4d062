"""Where the launcher's arguments end and the training script's begin.

torchrun declares the script's arguments as argparse ``REMAINDER``, yet argparse reads every word
of a command line as a possible option before it assigns any: a word after the script that
abbreviates two of the launcher's options (``--log``: ``--log-dir`` or ``--logs-specs``) is an
"ambiguous option" error, and elasticft's families of options (``--ckpt-*``, ``--plan-*``,
``--hang-*``...) make ``--ckpt`` and ``--plan`` such words too. So the command line is cut in two
before argparse sees it (:func:`split`). Its words are walked as argparse reads them, by the
parser's own reading of one word (exact name, unique prefix, ``--opt=value``, a short option with
its value attached) and each option's ``nargs``, up to the first positional word, the script (or
the word after ``--``). argparse parses that head alone, so ``--help`` and every error stay
argparse's own; the words after the script are the script's, verbatim (:func:`parse_args`).

Two words of the head are written differently, both to read as torchrun reads them: a boolean
option of elasticft (``--warm-start``) becomes ``--warm-start=VALUE``, so that it never takes the
script for its value, and an abbreviation that torchrun's own parser reads as one of its options
(``--re`` for ``--redirects``) is that option, where elasticft's options alone make it ambiguous.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any

from elasticft.options import DEST_PREFIX, FALSE_WORDS, TRUE_WORDS, boolean_flags

END_OF_OPTIONS = "--"


@dataclasses.dataclass(frozen=True)
class CommandLine:
    """One launcher command line, cut where the script starts."""

    head: list[str]
    """What argparse parses: the launcher's options, then the script (absent if none is given)."""
    given: list[str]
    """The option strings the head names, each as declared (``--nnodes`` for ``--nnod=2``)."""
    script_args: list[str]
    """Every word after the script, as given."""


def split(parser: argparse.ArgumentParser, argv: Sequence[str]) -> CommandLine:
    """Cuts ``argv`` where ``parser`` would find its first positional word, the script.

    An ambiguous abbreviation before the script is ``parser``'s own error, as under torchrun.
    """
    words = list(argv)
    booleans = boolean_flags()
    head: list[str] = []
    given: list[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        if word == END_OF_OPTIONS:
            end = min(i + 2, len(words))
            return CommandLine([*head, *words[i:end]], given, words[end:])
        word = _torch_abbreviation(parser, word)
        found = _read_option(parser, word)
        if found is None:  # the script
            return CommandLine([*head, word], given, words[i + 1:])
        action, option_string, value = found
        i += 1
        if action is None:  # no such option: argparse names it, the words after are read on
            head.append(word)
            continue
        given.append(option_string)
        if value is None and action.option_strings[0] in booleans:
            if i < len(words) and words[i].lower() in TRUE_WORDS | FALSE_WORDS:
                value, i = words[i], i + 1
            head.append(f"{word}={value or 'true'}")
            continue
        head.append(word)
        if value is None:
            taken = _values_taken(parser, action, words[i:])
            head += words[i:i + taken]
            i += taken
    return CommandLine(head, given, [])


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | CommandLine
               ) -> argparse.Namespace:
    """``parser.parse_args`` of the launcher's words (of ``argv``, or of its :func:`split`),
    with the script's words attached as they are to the positional that takes the rest
    (torchrun's ``training_script_args``)."""
    line = argv if isinstance(argv, CommandLine) else split(parser, argv)
    args = parser.parse_args(line.head)
    for action in parser._actions:
        if not action.option_strings and action.nargs == argparse.REMAINDER:
            setattr(args, action.dest, list(line.script_args))
    return args


def _read_option(parser: argparse.ArgumentParser, word: str
                 ) -> tuple[argparse.Action | None, str, str | None] | None:
    """How ``parser`` reads ``word``: None for a positional word, else (the action, None for an
    unknown option; the option string; the value written in the word, ``--opt=value``)."""
    try:
        found: Any = parser._parse_optional(word)
    except argparse.ArgumentError as e:  # Python >= 3.12 raises what 3.10 and 3.11 report
        parser.error(str(e))
    if found is None:
        return None
    if isinstance(found, list):  # Python >= 3.12.7: the one reading, in a list
        found = found[0]
    # (action, option string, value) up to 3.11, (action, option string, "=", value) in 3.12
    return found[0], found[1], found[-1]


def _is_positional(parser: argparse.ArgumentParser, word: str) -> bool:
    if word == END_OF_OPTIONS:
        return False
    return _read_option(parser, _torch_abbreviation(parser, word)) is None


def _values_taken(parser: argparse.ArgumentParser, action: argparse.Action,
                  following: list[str]) -> int:
    """How many of the ``following`` words ``action`` takes as its values: as argparse matches
    ``nargs``, greedily, against the positional words before the next option or ``--``."""
    nargs = action.nargs
    if nargs == 0:
        return 0
    if nargs in (None, argparse.OPTIONAL):
        at_most = 1
    elif isinstance(nargs, int):
        at_most = nargs
    else:  # *, + and the like: every positional word there is
        at_most = len(following)
    taken = 0
    while taken < min(at_most, len(following)) and _is_positional(parser, following[taken]):
        taken += 1
    return taken


def _torch_abbreviation(parser: argparse.ArgumentParser, word: str) -> str:
    """``word`` with an abbreviation of a torchrun option written in full where only elasticft's
    options make it ambiguous (``--re`` reads as ``--redirects``, as under torchrun, though
    ``--restart-on-user-error`` also starts so); any other word as it is."""
    prefix, equals, value = word.partition("=")
    actions = parser._option_string_actions
    if not (prefix.startswith("--") and parser.allow_abbrev) or prefix in actions:
        return word
    matches = [s for s in actions if s.startswith(prefix)]
    torchrun = [s for s in matches if not actions[s].dest.startswith(DEST_PREFIX)]
    if len(torchrun) == 1 and len(matches) > 1:
        return torchrun[0] + equals + value
    return word
