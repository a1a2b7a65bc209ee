"""The user's stop is a fact the CLI and the flow keep, not only an exception library code may swallow.

`sailor demo` once exited 0 after training every step (the SIGINT landed in a Prefect task during a
replan and was eaten) and once exited 1 with `ValueError: Task run is not set`, recording the run
`failed`. These tests drive the mechanism directly: a command that turns the signal into another error
or swallows it still exits 130/143, and the flow's safe points raise the stop again.
"""

from __future__ import annotations

import signal

import pytest
import typer

from sailor_cli import main as cli
from tasks import interrupt


@pytest.fixture
def one_command(monkeypatch):
    app = typer.Typer()
    box: dict[str, object] = {}

    @app.command()
    def job() -> None:
        box["run"]()  # type: ignore[operator]

    @app.callback()
    def _root() -> None:
        pass

    monkeypatch.setattr(cli, "app", app)
    monkeypatch.setattr(cli, "_register", lambda: None)
    yield box
    interrupt.clear()


def _swallowed(signum: int) -> None:
    interrupt.request(signum)  # what the handler does before it raises ...
    try:
        raise KeyboardInterrupt
    except BaseException:  # noqa: BLE001 - ... and what a library on the way did with it
        pass


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_swallowed_signal_still_exits_128_plus_it(one_command, sig, capsys):
    one_command["run"] = lambda: _swallowed(sig)
    assert cli.main(["job"]) == 128 + sig
    assert "interrupted by" in capsys.readouterr().err


def test_a_signal_turned_into_another_error_exits_130_not_1(one_command, capsys):
    def run() -> None:
        interrupt.request(signal.SIGINT)
        raise ValueError("Task run is not set")

    one_command["run"] = run
    assert cli.main(["job"]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and "interrupted by SIGINT" in err


def test_without_a_signal_errors_keep_their_code(one_command):
    def run() -> None:
        raise ValueError("a bug")

    one_command["run"] = run
    with pytest.raises(ValueError, match="a bug"):
        cli.main(["job"])


def test_the_flows_safe_points_raise_the_stop_again():
    interrupt.clear()
    interrupt.check()  # nothing requested: nothing raised
    interrupt.request(signal.SIGTERM)
    interrupt.request(signal.SIGINT)  # the first signal counts
    try:
        with pytest.raises(interrupt.Interrupted) as e:
            interrupt.check()
        assert e.value.signum == signal.SIGTERM
        assert not isinstance(e.value, Exception)  # no `except Exception` may swallow it
    finally:
        interrupt.clear()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_command_is_still_importing(tmp_path, sig):
    """Ctrl-C in the first tenths of a second (Python importing the CLI): exit 128 + signal with one line,
    not the traceback of whichever import it landed in (once exit 1 with a KeyboardInterrupt traceback).

    The signal is sent once the module runs (`-X importtime` reports typer's imports, which come after the
    handlers are set): earlier, it lands in the interpreter's own start-up, before any of the program's
    code, and CPython exits 1 with its own message whatever the program does."""
    import subprocess
    import sys

    from tests.paths import REPO

    p = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "sailor_cli.main", "plan", "--help"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                         env={**__import__("os").environ, "TMPDIR": str(tmp_path)})
    assert p.stderr is not None
    seen = []
    for line in p.stderr:  # import lines as each import ends; typer's come after the handlers are set
        seen.append(line)
        if "typer" in line:
            break
    p.send_signal(sig)  # the command is importing (or, on a fast machine, already running: its own handlers)
    out, err = p.communicate(timeout=60)
    err = "".join(seen) + err
    assert p.returncode == 128 + sig, (p.returncode, err[-800:])
    assert "Traceback" not in err, err[-1500:]
