"""Entry point of the `sailor` command.

Contract: each command group lives in its own module of this package and exposes a typer app
(`app`) or a command function; they are registered here. Errors the user can cause
(`SailorError` and its tree, sailor_core/errors.py) print one line on stderr without a traceback
and exit with the status `EXIT_CODES` gives their class: 2 for a user error, 1 for a `Failure`.
Command modules import their heavy dependencies (torch, Prefect, cloud SDKs) inside the
commands, so registering them all at start stays cheap.
"""

from __future__ import annotations

import os
import signal
import sys


def _stopped_before_start(signum: int, _frame: object) -> None:
    """SIGINT/SIGTERM while the command is still importing: nothing was started, so leave at once with
    128 + signal (a KeyboardInterrupt would print the traceback of whichever import it landed in)."""
    name = signal.Signals(signum).name
    os.write(2, f"interrupted by {name} before the command started; nothing was done\n".encode())
    os._exit(128 + signum)


# As the program (`sailor`, `python -m sailor_cli.main`), before the imports below: `_main` replaces
# these with the command's own handlers once everything is imported.
if __name__ == "__main__" or os.path.basename(sys.argv[0] if sys.argv else "") == "sailor":
    signal.signal(signal.SIGINT, _stopped_before_start)
    signal.signal(signal.SIGTERM, _stopped_before_start)

import importlib  # noqa: E402 - after the handlers above, on purpose
import threading  # noqa: E402
from typing import NoReturn  # noqa: E402

import typer  # noqa: E402

from sailor_core.errors import Failure, SailorError  # noqa: E402
from tasks import interrupt  # noqa: E402

app = typer.Typer(
    name="sailor",
    help="Plan, simulate, profile and train large models over heterogeneous, geo-distributed GPUs.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


@app.callback()
def _root() -> None:
    """Plan, simulate, profile and train large models over heterogeneous, geo-distributed GPUs."""
    # A callback keeps `sailor COMMAND ...` a group even while only one command is registered.

# (module in sailor_cli, attribute, name as a group or None for a single command)
_COMMANDS: list[tuple[str, str, str | None]] = [
    ("profiles", "app", "profiles"),
    ("simulate", "simulate", None),
    ("plan", "plan", None),
    ("profile", "app", "profile"),
    ("train", "train", None),
    ("convert", "convert", None),
    ("worker", "worker", None),
    ("runs", "app", "runs"),
    ("infra", "app", "infra"),
    ("demo", "demo", None),
    ("replay", "replay", None),
    ("data", "app", "data"),
]


# Commands that start processes (the ephemeral Prefect server, workers): a guardian ends them if the
# command dies without cleaning up (sailor_cli/lifeline.py).
_GUARDED = ("demo", "train", "profile")


def _register() -> None:
    for module, attr, group in _COMMANDS:
        mod = importlib.import_module(f"sailor_cli.{module}")
        obj = getattr(mod, attr)
        if group:
            app.add_typer(obj, name=group)
        else:
            app.command(name=module)(obj)


Terminated = interrupt.Terminated  # SIGTERM as an exception; the flow tells a stop by its class (tasks/interrupt.py)


def _on_sigterm(signum: int, _frame: object) -> None:
    interrupt.request(signum)
    raise Terminated(signum)


def _on_sigint(signum: int, _frame: object) -> None:
    interrupt.request(signum)
    raise KeyboardInterrupt


def _interrupted(e: BaseException) -> int:
    """Exit status of an interruption: 128 + the signal (130 SIGINT, 143 SIGTERM)."""
    code = 128 + (e.signum if isinstance(e, Terminated) else signal.SIGINT)
    typer.echo(f"interrupted by {signal.Signals(code - 128).name}; cleaned up, nothing more was done", err=True)
    return code


# Exit status by the error tree (sailor_core/errors.py): the nearest listed ancestor of an error's class
# decides. 2: the user can fix the input; 1: the outside world or a job failed (a cloud, a VM, training).
EXIT_CODES: dict[type[SailorError], int] = {SailorError: 2, Failure: 1}


def exit_code(e: SailorError) -> int:
    return next(EXIT_CODES[c] for c in type(e).__mro__ if c in EXIT_CODES)


def _run_app(argv: list[str] | None) -> object:
    """The command; once the user asked to stop, whatever it raised or returned, it ends as interrupted
    (a library on the way may have turned the signal's exception into another, or swallowed it)."""
    interrupt.clear()
    try:
        rv = app(args=argv, standalone_mode=False)
    except (KeyboardInterrupt, Terminated, interrupt.Interrupted):
        raise
    except BaseException:
        if (s := interrupt.requested()) is not None:
            raise Terminated(s) from None
        raise
    if (s := interrupt.requested()) is not None and not (isinstance(rv, int) and rv == 128 + s):
        raise Terminated(s)
    return rv


def main(argv: list[str] | None = None) -> int:
    """Run the command; the exit status is 0 on success, 2 for a user error, 1 for a failure and
    128 + signal when interrupted (after the command's cleanup ran).

    Called as the program (`sailor ...`, `python -m sailor_cli.main`: no `argv`, main thread) it does not
    return: it leaves through `_leave`. Called with `argv` (tests, other Python code) it returns the status.
    """
    if argv is not None or threading.current_thread() is not threading.main_thread():
        return _main(argv)
    try:
        code = _main(None)
    except (KeyboardInterrupt, Terminated) as e:  # landed outside the command's own try (e.g. starting the guardian)
        code = _interrupted(e)
    except BaseException:  # a bug: its traceback, as Python would print it, and the same way out
        import traceback

        traceback.print_exc()
        code = 1
    _leave(code)


def _s3_compat_environment(args: list[str]) -> None:
    """The AWS SDK reads the settings an S3-compatible endpoint needs from the process environment only
    (sailor_core/uris.py): add them here, the process's entry, when an argument, $SAILOR_STORE or
    `sailor worker`'s $SAILOR_LOG_URI names one; `sailor train`'s workers inherit them."""
    from sailor_core.uris import s3_compat_settings

    values = [a.partition("=")[2] if a.startswith("--") else a for a in args]
    values += [os.environ.get("SAILOR_STORE", ""), os.environ.get("SAILOR_LOG_URI", "")]
    os.environ.update(s3_compat_settings(values, os.environ))


def _leave(code: int) -> NoReturn:
    """End the process with `code` after the cleanup a normal interpreter exit runs, minus its last step.

    Why: pyarrow's thread pool can still be dropping the last reference to a Python `bytes` it read
    (the store reads Parquet from `pa.BufferReader(bytes)`; the dataset scanner releases its fragment
    on a pool thread after `read_table` returned). If that happens once the interpreter is finalising,
    the pool thread's PyGILState_Ensure ends it with pthread_exit, whose unwinding through Arrow's
    noexcept destructor calls std::terminate: "terminate called without an active exception" and
    exit 134, after the command had already printed its answer (core dumps: issue 25 item 5). Under
    load this hit 3 in 60 `sailor runs list` on a corrupt store.

    What a normal exit does, in its order (Py_FinalizeEx): join non-daemon threads, run the atexit
    callbacks (Prefect's services and ephemeral server, multiprocessing, logging, weakref.finalize,
    hence every TemporaryDirectory still open), flush stdout/stderr; these run here too. What is
    skipped: the finalisation proper (module teardown, C++ static destructors), the step that races
    with Arrow's threads. Nothing of ours relies on it: files are written through `with` and the
    commands' own cleanup (`finally`) ran before this point.
    """
    import atexit

    try:
        threading._shutdown()  # type: ignore[attr-defined]  # Py_FinalizeEx's wait_for_thread_shutdown
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - e.g. Ctrl-C while a thread is joined: still leave, do not hang
        code = code or 1
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # noqa: BLE001 - e.g. a closed pipe: Python's own exit status for it is 120
            code = code or 120
    os._exit(code)


def _main(argv: list[str] | None) -> int:
    _register()
    args = sys.argv[1:] if argv is None else argv
    _s3_compat_environment(args)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
        signal.signal(signal.SIGINT, _on_sigint)
        if argv is None and args and args[0] in _GUARDED:  # the program only: a caller in Python owns its children
            from sailor_cli.lifeline import hold

            hold()  # what this command starts dies with it, even on SIGKILL
    try:
        rv = _run_app(argv)
    except SailorError as e:
        typer.echo(f"error: {e}", err=True)
        return exit_code(e)
    except FileNotFoundError as e:
        typer.echo(f"error: {e.filename or e}: no such file; to fix: check the path", err=True)
        return 2
    except (KeyboardInterrupt, Terminated) as e:
        return _interrupted(e)
    except interrupt.Interrupted as e:
        return _interrupted(Terminated(e.signum))
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception as e:  # click's usage errors come here in non-standalone mode
        import click

        if isinstance(e, click.exceptions.Exit):
            return e.exit_code
        if isinstance(e, click.ClickException):
            e.show()
            return e.exit_code
        if isinstance(e, click.exceptions.Abort) or type(e).__name__ == "Abort":
            # click turns Ctrl-C into Abort; its cause tells an interruption from a refused prompt
            if isinstance(e.__cause__ or e.__context__, KeyboardInterrupt | Terminated):
                return _interrupted(e.__cause__ or e.__context__)  # type: ignore[arg-type]
            return 1
        # typer >= 0.29 vendors click (typer._click): its usage errors are not click's classes
        if hasattr(e, "show") and isinstance(getattr(e, "exit_code", None), int):
            e.show()
            return int(getattr(e, "exit_code"))  # noqa: B009 - Exception has no exit_code for mypy
        if type(e).__name__ == "Exit":
            return int(getattr(e, "exit_code", 1) or 0)
        raise
    # In non-standalone mode click returns `typer.Exit(n)`'s code (or the command's return value);
    # typer turns Ctrl-C into Exit(130), so it arrives here too.
    if isinstance(rv, int) and not isinstance(rv, bool):
        if rv == 128 + signal.SIGINT:
            typer.echo("interrupted by SIGINT; cleaned up, nothing more was done", err=True)
        return rv
    return 0


if __name__ == "__main__":
    sys.exit(main())
