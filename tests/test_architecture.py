"""The dependency rule of docs/architecture.md, checked on the import statements of every module.

flows -> tasks -> {infra, profiles_store, sailor_core}; infra and profiles_store -> sailor_core;
sailor_cli sits on top and nothing imports it. The simulator and planner import no torch, Prefect,
pyarrow or cloud SDK; Prefect is imported only by tasks and flows; cloud SDKs only inside infra/aws
and infra/gcp. Every package has a rule, and the import table of docs/architecture.md lists exactly
the third-party modules each package imports.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CLOUD_SDKS = {"boto3", "botocore", "google"}
FIRST_PARTY = {"sailor_core", "profiles_store", "infra", "tasks", "flows", "sailor_cli"}
NOT_SHIPPED = {"tests", "bench", "build", ".venv"}  # folders that are not packages of the distribution


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


def modules(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


FORBIDDEN = {
    # pyarrow is allowed in the runtime (datasets, checkpoints on object storage), never in PURE below.
    "sailor_core": {"prefect", "flows", "tasks", "infra", "profiles_store", "sailor_cli"} | CLOUD_SDKS,
    "profiles_store": {"prefect", "flows", "tasks", "infra", "sailor_cli", "torch"} | CLOUD_SDKS,
    "infra": {"prefect", "flows", "tasks", "sailor_cli"},
    "tasks": {"flows", "sailor_cli"},
    "flows": {"sailor_cli"},
    # The command line runs flows and tasks and reads the store; Prefect's API stays in tasks and flows.
    "sailor_cli": {"prefect"} | CLOUD_SDKS,
}
PURE = {"sailor_core/simulator", "sailor_core/planner", "sailor_core/domain.py", "sailor_core/profiles.py",
        "sailor_core/plan_format.py", "sailor_core/catalog.py", "sailor_core/replay", "sailor_core/decisions.py"}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_arrows_point_one_way(package: str) -> None:
    bad = []
    for path in modules(package):
        wrong = imports_of(path) & FORBIDDEN[package]
        if wrong:
            bad.append(f"{path.relative_to(REPO)} imports {sorted(wrong)}")
    assert not bad, "dependency rule broken:\n" + "\n".join(bad)


def test_every_package_has_a_rule() -> None:
    packages = {p.parent.name for p in REPO.glob("*/__init__.py") if p.parent.name not in NOT_SHIPPED}
    assert packages == FIRST_PARTY
    assert set(FORBIDDEN) == FIRST_PARTY, f"packages without a dependency rule: {sorted(FIRST_PARTY - set(FORBIDDEN))}"


def test_nothing_imports_the_command_line() -> None:
    assert all("sailor_cli" in FORBIDDEN[p] for p in FIRST_PARTY - {"sailor_cli"})


def test_simulator_and_planner_are_pure() -> None:
    bad = []
    for rel in PURE:
        p = REPO / rel
        for path in [p] if p.is_file() else sorted(p.rglob("*.py")):
            wrong = imports_of(path) & ({"torch", "pyarrow", "pandas", "prefect"} | CLOUD_SDKS)
            if wrong:
                bad.append(f"{path.relative_to(REPO)} imports {sorted(wrong)}")
    assert not bad, "pure core imports a heavy dependency:\n" + "\n".join(bad)


def test_cloud_sdks_only_in_their_providers() -> None:
    bad = []
    for path in REPO.rglob("*.py"):
        rel = path.relative_to(REPO)
        if rel.parts[0] in NOT_SHIPPED or rel.parts[:2] in {("infra", "aws"), ("infra", "gcp")}:
            continue
        wrong = imports_of(path) & CLOUD_SDKS
        if wrong:
            bad.append(f"{rel} imports {sorted(wrong)}")
    assert not bad, "cloud SDK imported outside infra/aws or infra/gcp:\n" + "\n".join(bad)


def test_rule_detects_a_wrong_arrow(tmp_path: Path) -> None:
    bad = tmp_path / "m.py"
    bad.write_text("import prefect\nfrom flows.x import y\nfrom . import z\n")
    assert imports_of(bad) & FORBIDDEN["sailor_core"] == {"prefect", "flows"}
    bad.write_text("import sailor_cli.main\n")
    assert imports_of(bad) & FORBIDDEN["flows"] == {"sailor_cli"}


# -- the import table of docs/architecture.md --------------------------------------------------------------


def third_party_imports(package: str) -> set[str]:
    out: set[str] = set()
    for path in modules(package):
        out |= imports_of(path)
    return out - set(sys.stdlib_module_names) - FIRST_PARTY - {"__future__"}


def documented_imports(text: str) -> dict[str, set[str]]:
    """Row `package` of the table -> the module names in backticks of its 'may import' column."""
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        m = re.fullmatch(r"`(\w+)`", cells[0]) if len(cells) == 3 else None
        if m:
            out[m.group(1)] = set(re.findall(r"`([a-z_][a-z0-9_]*)`", cells[2]))
    return out


def test_architecture_table_lists_the_real_imports() -> None:
    table = documented_imports((REPO / "docs" / "architecture.md").read_text())
    assert set(table) == FIRST_PARTY, "docs/architecture.md's table must have one row per package"
    wrong = []
    for package, named in sorted(table.items()):
        real = third_party_imports(package)
        if named - FIRST_PARTY != real:
            wrong.append(f"{package}: the table says {sorted(named - FIRST_PARTY)}, the code imports {sorted(real)}")
        allowed = named & FIRST_PARTY | {package}
        used = set().union(*(imports_of(p) for p in modules(package))) & FIRST_PARTY
        if not used <= allowed:
            wrong.append(f"{package}: imports {sorted(used - allowed)} that its row does not name")
    assert not wrong, "docs/architecture.md's import table is stale:\n" + "\n".join(wrong)


def test_table_reader_finds_rows_and_names() -> None:
    text = ("| package | holds | may import |\n|---|---|---|\n"
            "| `tasks` | x `a.py` | `sailor_core`, `prefect` (`infra/aws`) |\n")
    assert documented_imports(text) == {"tasks": {"sailor_core", "prefect"}}
