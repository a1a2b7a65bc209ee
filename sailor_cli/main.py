"""Entry point of the `sailor` command.

Contract: each command group lives in its own module of this package and exposes a typer app
(`app`) or a command function; they are registered here. Errors the user can cause
(`SailorError`, `ValidationError`) print one line on stderr and exit 2 without a traceback.
Command modules import their heavy dependencies (torch, Prefect, cloud SDKs) inside the
commands, so registering them all at start stays cheap.
"""

from __future__ import annotations

import importlib
import sys

import typer

from sailor_core.domain import SailorError, ValidationError

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
    ("worker", "worker", None),
    ("runs", "app", "runs"),
    ("infra", "app", "infra"),
    ("demo", "demo", None),
    ("replay", "replay", None),
    ("data", "app", "data"),
]


def _register() -> None:
    for module, attr, group in _COMMANDS:
        mod = importlib.import_module(f"sailor_cli.{module}")
        obj = getattr(mod, attr)
        if group:
            app.add_typer(obj, name=group)
        else:
            app.command(name=module)(obj)


def main(argv: list[str] | None = None) -> int:
    _register()
    try:
        app(args=argv, standalone_mode=False)
    except (SailorError, ValidationError) as e:
        typer.echo(f"error: {e}", err=True)
        return 2
    except FileNotFoundError as e:
        typer.echo(f"error: {e.filename or e}: no such file; to fix: check the path", err=True)
        return 2
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        return 130
    except SystemExit as e:
        return int(e.code or 0)
    except Exception as e:  # click's usage errors come here in non-standalone mode
        import click

        if isinstance(e, click.exceptions.Exit):
            return e.exit_code
        if isinstance(e, click.ClickException):
            e.show()
            return e.exit_code
        if isinstance(e, click.exceptions.Abort):
            return 1
        # typer >= 0.29 vendors click (typer._click): its usage errors are not click's classes
        if hasattr(e, "show") and isinstance(getattr(e, "exit_code", None), int):
            e.show()
            return int(e.exit_code)
        if type(e).__name__ in ("Exit", "Abort"):
            return int(getattr(e, "exit_code", 1) or 0)
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
