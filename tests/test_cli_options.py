"""The `sailor` commands share one definition per option (sailor_cli/options.py) and one option style.

Walks the typer app as `sailor` registers it: every command's `--store` reads the same; every flag
options.py defines reads as options.py says wherever a command takes it, except the documented
commands where the same flag means something else; no flag repeats across commands without a
shared definition; and no command declares an option as a default argument (the older style).
"""

from __future__ import annotations

import ast
import typing
from collections import defaultdict
from pathlib import Path

import pytest
import typer

from sailor_cli import main as cli_main
from sailor_cli import options

CLI_DIR = Path(cli_main.__file__).parent

# (command, flag) pairs where the flag means something else than the shared option (options.py's contract)
OWN_MEANING = {
    ("plan", "--out"), ("profiles export", "--out"), ("data prepare", "--out"),
    ("simulate", "--recompute"), ("train", "--recompute"),
    ("demo", "--workers"), ("profile network", "--workers"),
    ("profile network", "--zone"), ("infra provision", "--zone"), ("infra provision", "--gpu-type"),
    ("infra provision", "--market"), ("infra catalog", "--cloud"), ("profile network", "--provider"),
}


def _commands() -> dict[str, dict[str, str | None]]:
    """{command path: {flag: help}} for every command of the `sailor` app."""
    cli_main._register()
    out: dict[str, dict[str, str | None]] = {}

    def walk(cmd: typing.Any, path: list[str]) -> None:
        subs = getattr(cmd, "commands", None)
        if subs:
            for name, sub in subs.items():
                walk(sub, [*path, name])
            return
        out[" ".join(path)] = {max(p.opts, key=len): p.help for p in cmd.params if p.param_type_name == "option"}

    walk(typer.main.get_command(cli_main.app), [])
    return out


def _shared() -> dict[str, set[str]]:
    """{flag: its help texts} of every option options.py defines."""
    found: dict[str, set[str]] = defaultdict(set)
    for value in vars(options).values():
        if typing.get_origin(value) is typing.Annotated:
            for meta in value.__metadata__:
                if isinstance(meta, typer.models.OptionInfo):
                    # in Annotated, typer reads the first positional argument (`default`) as the flag
                    decls = [d for d in (meta.default, *meta.param_decls) if isinstance(d, str)]
                    found[max(decls, key=len)].add(meta.help)
    return found


def test_every_store_option_has_the_same_help() -> None:
    helps = {cmd: flags["--store"] for cmd, flags in _commands().items() if "--store" in flags}
    assert len(helps) >= 10, helps  # plan, simulate, replay, demo, runs x2, profiles x4, profile x3, infra cleanup
    assert set(helps.values()) == _shared()["--store"], helps
    assert len(_shared()["--store"]) == 1


def test_shared_options_read_as_options_py_defines_them() -> None:
    shared = _shared()
    assert {"--store", "--json", "--model", "--global-batch-size", "--workdir", "--run"} <= set(shared)
    wrong = [(cmd, flag, help_) for cmd, flags in _commands().items() for flag, help_ in flags.items()
             if flag in shared and (cmd, flag) not in OWN_MEANING and help_ not in shared[flag]]
    assert not wrong, wrong


def test_no_flag_repeats_without_a_shared_definition() -> None:
    users: dict[str, list[str]] = defaultdict(list)
    for cmd, flags in _commands().items():
        for flag in flags:
            if (cmd, flag) not in OWN_MEANING:
                users[flag].append(cmd)
    repeated = {flag: cmds for flag, cmds in users.items() if len(cmds) > 1 and flag not in _shared()}
    assert not repeated, f"define these once in sailor_cli/options.py: {repeated}"


@pytest.mark.parametrize("module", sorted(p.name for p in CLI_DIR.glob("*.py")))
def test_options_are_declared_with_annotated_not_as_default_arguments(module: str) -> None:
    tree = ast.parse((CLI_DIR / module).read_text())
    old = [f"{module}:{d.lineno}" for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef)
           for d in [*fn.args.defaults, *fn.args.kw_defaults]
           if isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr in ("Option", "Argument")]
    assert not old, f"declare these as Annotated[..., typer.Option(...)]: {old}"


def test_split_values_takes_repeats_and_commas() -> None:
    assert options.split_values(["a", "b, c", " ", ""]) == ("a", "b", "c")
    assert options.split_values(None) == ()


def test_docs_cli_lists_every_shared_flag_and_exception() -> None:
    text = (CLI_DIR.parent / "docs" / "cli.md").read_text()
    missing = [flag for flag in _shared() if f"`{flag}`" not in text]
    missing += [flag for _, flag in OWN_MEANING if f"`{flag}`" not in text]
    assert not missing, f"docs/cli.md does not name {missing}"
