"""The console script: every subcommand has --help."""

from __future__ import annotations

import pytest

from tierd.cli import COMMANDS, build_parser


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_has_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`tierd NAME --help` exits 0 and describes the command."""
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([name, "--help"])
    assert exit_info.value.code == 0
    assert "usage: tierd " + name in capsys.readouterr().out
