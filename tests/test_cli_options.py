"""The `sailor` commands share one definition per option (sailor_cli/options.py) and one option style.

Walks the typer app as `sailor` registers it: every command's `--store` reads the same; every flag
options.py defines reads as options.py says wherever a command takes it, except the documented
commands where the same flag means something else; no flag repeats across commands without a
shared definition; and no command declares an option as a default argument (the older style).
"""

from __future__ import annotations

import ast
import json
import os
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


# -- inputs refused before anything starts (issue 25 item 6) ---------------------------------------------------------
TINY_PLAN = {"format": "sailor-plan", "version": 1, "model": "gpt-tiny", "global_batch_size": 8, "schedule": "1f1b",
             "precision": "fp32", "zero1": False,
             "stages": [{"layers": [0, 5], "replicas": [{"gpu_type": "cpu", "gpus_per_node": 1, "zone": "local",
                                                         "region": "local", "market": "on-demand", "tp": 1}]}],
             "pipelines": [{"microbatch_size": 8, "num_microbatches": 1}]}


@pytest.fixture
def no_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting workers (or the guardian that outlives them) fails the test: the error must come first."""
    from sailor_cli import lifeline
    from sailor_core.runtime import launcher

    def started(*_: object, **__: object) -> None:
        raise AssertionError("a worker was started before the input was refused")

    monkeypatch.setattr(launcher, "run_local", started)
    monkeypatch.setattr(lifeline, "hold", lambda *_: None)


def _one_line_exit_2(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    rc = cli_main.main(list(argv))
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and "to fix" in lines[0], err
    return lines[0]


@pytest.mark.parametrize(("flags", "expect"), [
    (["--data", "{tmp}/nonexistent"], "--data {tmp}/nonexistent does not exist"),
    (["--data", "file://{tmp}/nonexistent"], "does not exist"),
    (["--metrics-out", "{tmp}/nonexistent-dir/m.jsonl"], "folder {tmp}/nonexistent-dir does not exist"),
    (["--metrics-out", "{tmp}"], "is a folder, not a file"),
    (["--checkpoint-dir", "{tmp}/a-file"], "--checkpoint-dir {tmp}/a-file is a file, not a folder"),
    (["--checkpoint-dir", "{tmp}/a-file/ck"], "{tmp}/a-file is a file"),
    (["--log-dir", "{tmp}/a-file"], "--log-dir {tmp}/a-file is a file"),
    (["--export", "{tmp}/a-file", "--checkpoint-dir", "{tmp}/ck"], "--export {tmp}/a-file is a file"),
    (["--resume", "--resume-or-start", "--checkpoint-dir", "{tmp}/ck"], "exclude each other"),
    (["--checkpoint-interval", "3", "--checkpoint-every", "5"], "disagree"),
])
def test_train_refuses_bad_paths_before_any_worker_starts(tmp_path, capsys, no_start, flags, expect) -> None:  # noqa: ANN001
    (tmp_path / "plan.json").write_text(json.dumps(TINY_PLAN))
    (tmp_path / "a-file").write_text("x")
    argv = [f.format(tmp=tmp_path) for f in flags]
    line = _one_line_exit_2(capsys, "train", str(tmp_path / "plan.json"), "--steps", "2", *argv)
    assert expect.format(tmp=tmp_path) in line
    assert not (tmp_path / "ck").exists()  # no checkpoint folder was touched either


def test_train_leaves_remote_data_and_existing_folders_to_the_run(tmp_path, capsys, no_start, monkeypatch) -> None:  # noqa: ANN001
    from sailor_core.runtime import token_shards

    monkeypatch.setattr(token_shards, "check_dataset", lambda *_: None)  # it would look for a prepared index in s3://
    (tmp_path / "plan.json").write_text(json.dumps(TINY_PLAN))
    (tmp_path / "shards").mkdir()
    for data in ("s3://bucket/corpus", "gs://bucket/corpus", str(tmp_path / "shards")):
        with pytest.raises(AssertionError, match="a worker was started"):  # every check passed
            cli_main.main(["train", str(tmp_path / "plan.json"), "--steps", "2", "--data", data,
                           "--checkpoint-dir", str(tmp_path / "new" / "ck"), "--log-dir", str(tmp_path / "logs"),
                           "--metrics-out", str(tmp_path / "m.jsonl")])
    capsys.readouterr()


@pytest.mark.parametrize(("flags", "interval"), [
    ([], 0), (["--checkpoint-interval", "4"], 4), (["--checkpoint-every", "6"], 6),
    (["--checkpoint-interval", "6", "--checkpoint-every", "6"], 6),
])
def test_train_checkpoint_interval_and_its_older_name(tmp_path, capsys, no_start, monkeypatch, flags,  # noqa: ANN001
                                                      interval) -> None:
    from sailor_core.runtime import launcher
    from sailor_core.runtime.engine import TrainSettings

    def started(_plan: object, _cfg: object, settings: TrainSettings, **_: object) -> None:
        raise AssertionError(f"started with checkpoint_interval={settings.checkpoint_interval}")

    monkeypatch.setattr(launcher, "run_local", started)
    (tmp_path / "plan.json").write_text(json.dumps(TINY_PLAN))
    with pytest.raises(AssertionError, match=f"started with checkpoint_interval={interval}$"):
        cli_main.main(["train", str(tmp_path / "plan.json"), "--steps", "2", "--checkpoint-dir", str(tmp_path / "ck"),
                       *flags])
    capsys.readouterr()


def test_plan_with_a_folder_as_the_pool_is_one_line(tmp_path, capsys) -> None:  # noqa: ANN001
    line = _one_line_exit_2(capsys, "plan", "--pool", str(tmp_path), "--model", "OPT-350", "--global-batch-size", "8")
    assert f"--pool {tmp_path} is a folder" in line and "Traceback" not in line


def test_replay_checks_the_trace_path_before_reading_the_store(tmp_path, capsys, monkeypatch) -> None:  # noqa: ANN001
    import sailor_cli.replay as replay

    monkeypatch.setattr(replay, "load_model_book", lambda *_: pytest.fail("the store was read first"))
    line = _one_line_exit_2(capsys, "replay", "--trace", str(tmp_path / "none.json"), "--model", "OPT-350",
                            "--global-batch-size", "1024", "--steps", "10")
    assert "does not exist" in line
    line = _one_line_exit_2(capsys, "replay", "--trace", str(tmp_path), "--model", "OPT-350",
                            "--global-batch-size", "1024", "--steps", "10")
    assert "is a folder" in line


@pytest.mark.parametrize("flag", ["--workdir", "--store"])
def test_demo_refuses_a_file_as_its_folders_before_anything_starts(tmp_path, capsys, no_start, flag) -> None:  # noqa: ANN001
    (tmp_path / "a-file").write_text("x")
    line = _one_line_exit_2(capsys, "demo", "--steps", "5", flag, str(tmp_path / "a-file"))
    assert f"{flag} {tmp_path / 'a-file'} is a file, not a folder" in line
    assert not (tmp_path / ".prefect").exists()  # the Prefect home was not even chosen


def test_the_cli_adds_the_sdk_settings_an_s3_endpoint_needs_to_its_own_environment(monkeypatch) -> None:  # noqa: ANN001
    from sailor_core.uris import S3_COMPAT_ENV

    for k in (*S3_COMPAT_ENV, "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "SAILOR_STORE", "SAILOR_LOG_URI"):
        monkeypatch.delenv(k, raising=False)
    cli_main._s3_compat_environment(["plan", "--store", "s3://bkt/x"])  # AWS itself: nothing to add
    assert not any(k in os.environ for k in S3_COMPAT_ENV)
    cli_main._s3_compat_environment(["plan", "--store=s3://bkt/x?endpoint_override=127.0.0.1:9"])
    assert {k: os.environ[k] for k in S3_COMPAT_ENV} == S3_COMPAT_ENV
