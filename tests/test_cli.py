"""``python -m cutemk``: bad arguments are usage errors (one line, exit 2), not tracebacks
from deep inside the demo (a negative token count was torch's "negative dimension")."""

import pytest

from cutemk.__main__ import main


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--tokens", "-3"], "argument --tokens: -3 is not positive"),
        (["demo", "--hidden", "x"], "argument --hidden: 'x' is not a whole number"),
        (["demo", "--tokens", "300", "--max-tokens", "256"], "--tokens 300 is past --max-tokens"),
        (["demo", "--experts", "2", "--top-k", "4"], "--top-k 4 is more than --experts 2"),
        (["trace", "--tokens", "0"], "argument --tokens: 0 is not positive"),
    ],
)
def test_bad_arguments_are_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_the_demo_runs_on_the_cpu(capsys):
    argv = ["demo", "--cpu", "--tokens", "3", "17", "--max-tokens", "32"]
    assert main(argv + ["--hidden", "64", "--intermediate", "32"]) == 0
    assert "demo: all checks passed" in capsys.readouterr().out
