"""One error tree (sailor_core/errors.py): every error class of every package derives from `SailorError`;
what a caller needs from an error is in its fields (`MissingProfileError`), not in its message; providers'
errors are in the tree; the CLI's exit status follows the tree.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import os
import pickle
import re
import signal
from dataclasses import replace
from pathlib import Path

import pytest

from sailor_core import errors
from sailor_core.errors import (
    CapacityError,
    Failure,
    MissingProfileError,
    ProfilingWorkerError,
    ProviderError,
    SailorError,
    TestbedError,
    ValidationError,
)
from tests.paths import REPO
from tests.planner_fixtures import MODEL, tiny_book
from tests.test_simulator import make_book, plan_of, rep

PACKAGES = ("sailor_core", "profiles_store", "infra", "tasks", "flows", "sailor_cli")
# Not errors: signals turned into exceptions (BaseException, like KeyboardInterrupt) so `finally` runs.
SIGNALS = {"tasks.interrupt.Terminated", "sailor_core.runtime.checkpoint_writer.RetentionCancelled",
           "tasks.interrupt.Interrupted"}
_BUILTIN_EXCEPTIONS = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}


def _base_name(node: ast.expr) -> str:
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""


def exception_classes(root: Path, packages: tuple[str, ...]) -> list[tuple[str, str]]:
    """(module, class) of every class defined in the packages' modules that is an exception: its bases
    name a built-in exception or another such class (by name, to a fixed point; no module is imported)."""
    classes: list[tuple[str, str, set[str]]] = []
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.ClassDef):
                    classes.append((module, node.name, {_base_name(b) for b in node.bases}))
    known = set(_BUILTIN_EXCEPTIONS)
    while True:
        more = {name for _, name, bases in classes if bases & known} - known
        if not more:
            break
        known |= more
    return [(module, name) for module, name, bases in classes if bases & known]


def test_the_scan_finds_an_error_class_outside_the_tree(tmp_path: Path) -> None:
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "sub" / "mod.py").write_text(
        "import click\nclass A(ValueError): ...\nclass B(A): ...\nclass C(click.ClickException): ...\n"
        "class D: ...\nclass E(D): ...\n")
    assert sorted(exception_classes(tmp_path, ("pkg",))) == [("pkg.sub.mod", "A"), ("pkg.sub.mod", "B")]


def test_every_error_class_of_every_package_derives_from_the_one_root() -> None:
    found = exception_classes(REPO, PACKAGES)
    in_tree = {name for module, name in found if module == "sailor_core.errors"}
    assert {"SailorError", "ValidationError", "MissingProfileError", "ProviderError", "CapacityError"} <= in_tree
    outside = []
    for module, name in found:
        cls = getattr(importlib.import_module(module), name)
        if f"{module}.{name}" in SIGNALS:
            assert not issubclass(cls, Exception)  # a signal, not an error
        elif not issubclass(cls, SailorError):
            outside.append(f"{module}.{name} ({', '.join(c.__name__ for c in cls.__mro__[1:])})")
    assert not outside, "error classes outside the tree of sailor_core.errors.SailorError: " + "; ".join(outside)


def _tree() -> list[tuple[int, str]]:
    """(depth, class name) of each line of the tree drawn in sailor_core/errors.py's docstring."""
    doc = errors.__doc__ or ""
    rows = []
    for line in doc.splitlines():
        m = re.match(r"^    ((?:[│ ]   )*)(?:[├└]── )?([A-Z]\w+)\s{2,}", line)
        if m:
            rows.append((len(m.group(1)) // 4 + (1 if "──" in line else 0), m.group(2)))
    return rows


def test_the_docstring_tree_is_the_class_tree() -> None:
    rows = _tree()
    classes = {n: c for n, c in vars(errors).items() if inspect.isclass(c) and issubclass(c, BaseException)}
    assert sorted(n for _, n in rows) == sorted(classes), "the tree in errors.py lists every class once"
    parents: list[str] = []
    for depth, name in rows:
        parents = parents[:depth]
        if parents:
            assert classes[name].__bases__[0] is classes[parents[-1]], f"{name} is drawn under {parents[-1]}"
        parents.append(name)


def test_old_import_paths_give_the_same_classes() -> None:
    from infra.metadata import MetadataUnavailable
    from infra.testbed import TestbedError as TestbedModuleError
    from sailor_core.profiles import MissingProfileError as ProfilesMissing
    from sailor_core.runtime.protocol import ProtocolError

    assert ProfilesMissing is MissingProfileError and TestbedModuleError is TestbedError
    assert MetadataUnavailable is errors.MetadataUnavailable and ProtocolError is errors.ProtocolError


def test_the_provider_protocol_does_not_re_export_errors() -> None:
    """infra.provider's error re-exports were imported only by tests: one import path per class."""
    import infra.provider

    assert not hasattr(infra.provider, "ProviderError") and not hasattr(infra.provider, "CapacityError")


def test_a_provider_error_is_a_sailor_error_and_a_failure() -> None:
    for cls in (ProviderError, CapacityError, TestbedError):
        e = cls("no capacity for a2-highgpu-1g in us-central1-a; to fix: allow another zone")
        assert isinstance(e, SailorError) and isinstance(e, Failure)
    assert issubclass(CapacityError, ProviderError) and issubclass(TestbedError, ProviderError)
    # a validation error is a user error, and still the ValueError parsers are caught as
    assert issubclass(ValidationError, ValueError) and not issubclass(ValidationError, Failure)
    assert issubclass(errors.PeerLost, RuntimeError)


def test_exit_codes_follow_the_tree() -> None:
    from sailor_cli.main import EXIT_CODES, exit_code

    assert EXIT_CODES == {SailorError: 2, Failure: 1}
    for cls in vars(errors).values():
        if inspect.isclass(cls) and issubclass(cls, SailorError):
            assert exit_code(cls("x")) == (1 if issubclass(cls, Failure) else 2), cls.__name__
    from sailor_cli.infra import CloudUnreachable

    assert exit_code(CloudUnreachable("x")) == 1 and exit_code(errors.TrainingFailed("x")) == 1
    assert exit_code(ValidationError("x")) == 2 and exit_code(errors.PlanFormatError("x")) == 2


# --- MissingProfileError's fields --------------------------------------------------------------------


def test_a_missing_layer_profile_names_its_key_in_fields() -> None:
    book = make_book()
    with pytest.raises(MissingProfileError) as e:
        book.layers("G1", 8, 1)
    err = e.value
    assert (err.kind, err.model, err.gpu_type, err.mbs, err.tp, err.link) == ("layers", "tiny", "G1", 8, 1, None)
    assert err.what == "no layer profile for (model=tiny, gpu_type=G1, mbs=8, tp=1)"
    assert err.fix is not None and err.fix.startswith("sailor profile model --model tiny --mbs 8 --tp 1")
    assert str(err) == f"{err.what}; to fix: {err.fix}"


def test_an_unknown_gpu_type_and_a_missing_intra_node_link_are_kinds_too() -> None:
    book = make_book()
    with pytest.raises(MissingProfileError) as e:
        book.gpu("H100")
    assert (e.value.kind, e.value.gpu_type) == ("gpu-type", "H100") and "to fix: use one of" in str(e.value)
    no_intra = replace(make_book(), intra_node=())
    # two stages on one node of G1 talk over the intra-node link
    plan = plan_of([(0, 1, [rep()]), (2, 3, [rep()])], [(2, 2)])
    from sailor_core.simulator import simulate

    with pytest.raises(MissingProfileError) as e:
        simulate(plan, no_intra)
    assert (e.value.kind, e.value.gpu_type, e.value.model) == ("intra-node", "G1", "tiny")


def test_a_missing_link_carries_the_link_key_and_survives_pickling() -> None:
    from sailor_core.simulator import simulate

    book = replace(make_book(), links=tuple(lk for lk in make_book().links if lk.sender_zone == lk.receiver_zone))
    plan = plan_of([(0, 1, [rep(zone="za", gpn=1)]), (2, 3, [rep(zone="zb", gpn=1)])], [(2, 2)])
    with pytest.raises(MissingProfileError) as e:
        simulate(plan, book)
    err = e.value
    assert err.kind == "link" and err.link is not None
    assert {err.link[0], err.link[3]} == {"za", "zb"} and err.link[1] == err.link[4] == "G1"
    assert err.what.startswith("no network profile for G1") and "--from" in (err.fix or "")
    # Prefect and multiprocessing pickle errors: the fields come back
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is MissingProfileError and str(back) == str(err)
    assert (back.kind, back.link, back.what, back.fix) == (err.kind, err.link, err.what, err.fix)


def test_the_planner_lists_missing_links_from_the_fields_not_the_message() -> None:
    from sailor_core.domain import Capacity, ResourcePool
    from sailor_core.planner import PlanRequest, plan

    full = tiny_book(3)
    book = replace(full, links=tuple(lk for lk in full.links if lk.sender_zone == lk.receiver_zone))
    pool = ResourcePool(entries=tuple(
        Capacity(zone=z, region="r1", gpu_type="fast", gpus=2, gpus_per_vm=2, usd_per_gpu_hour=2.0)
        for z in ("r1-a", "r1-b")))
    r = plan(PlanRequest(model=MODEL, global_batch_size=16, pool=pool), book)
    m = re.search(r"plans needing these links were left out: (.*?) \(to fix: sailor profile network between them\)",
                  r.nearest_miss)
    assert m, r.nearest_miss
    assert m.group(1).split("; ") == ["fast in r1-a <-> fast in r1-b"], m.group(1)  # once, whatever the sizes


# --- a profiling worker's failure says in fields whether it ran out of memory --------------------------


def _worker_raises_memory_error(rank: int, world_size: int, init_method: str, emit, kind: str) -> None:  # noqa: ANN001
    if kind == "memory":
        raise MemoryError("the allocator gave up")
    if kind == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    raise ValueError("a bug, not memory")


@pytest.mark.e2e  # a real profiling worker process each (torch imported in each)
@pytest.mark.parametrize(("kind", "oom"), [("memory", True), ("killed", True), ("bug", False)])
def test_a_profiling_worker_failure_carries_rank_and_out_of_memory(kind: str, oom: bool) -> None:
    from sailor_core.profiler.spawn import run_workers

    with pytest.raises(ProfilingWorkerError) as e:
        run_workers(_worker_raises_memory_error, 1, (kind,), timeout_s=120)
    assert (e.value.rank, e.value.out_of_memory) == (0, oom), str(e.value)
    assert e.value.returncode == (-signal.SIGKILL if kind == "killed" else None)
