"""Every option of every ``conveyor`` command has a help text.

Each command parses its own flags (``conveyor/cli.py``), so the parsers are read the way a
user meets them: ``conveyor COMMAND --help``. A wrapper around ``parse_args`` records the
parser (and its subcommands' parsers) before argparse prints the help and exits.
"""

from __future__ import annotations

import argparse

import pytest

from conveyor.bench.cli import BENCHMARKS
from conveyor.cli import COMMANDS
from conveyor.cli import main as conveyor_main

COMMAND_LINES = [[name] for name in COMMANDS if name != "bench"] + [
    ["bench", kind] for kind in BENCHMARKS
]


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _parsers(sub)
    return found


@pytest.mark.parametrize("command", COMMAND_LINES, ids=" ".join)
def test_every_option_has_a_help_text(command, monkeypatch, capsys):
    seen: list[argparse.ArgumentParser] = []
    parse_args = argparse.ArgumentParser.parse_args

    def recording_parse_args(self, *args, **kwargs):
        seen.append(self)
        return parse_args(self, *args, **kwargs)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", recording_parse_args)
    with pytest.raises(SystemExit) as exit_:
        conveyor_main([*command, "--help"])
    assert exit_.value.code == 0
    assert seen, f"conveyor {' '.join(command)} --help parsed nothing"
    assert "usage:" in capsys.readouterr().out
    missing = [
        f"{parser.prog} {action.option_strings[0]}"
        for top in seen
        for parser in _parsers(top)
        for action in parser._actions
        if action.option_strings
        and not action.help
        and not isinstance(action, argparse._HelpAction)
    ]
    assert not missing, f"options without a help text: {missing}"
