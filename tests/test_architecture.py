"""The dependency rule of docs/architecture.md, checked on the import statements of every module.

flows -> tasks -> {infra, profiles_store, sailor_core}; infra and profiles_store -> sailor_core.
The simulator and planner import no torch, Prefect, pyarrow or cloud SDK; sailor_core imports no
Prefect or cloud SDK at all; cloud SDKs are imported only inside infra/aws and infra/gcp.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CLOUD_SDKS = {"boto3", "botocore", "google"}


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
    "infra": {"flows", "tasks", "sailor_cli"},
    "tasks": {"flows", "sailor_cli"},
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
        if rel.parts[0] in {".venv", "tests", "bench", "build"} or rel.parts[:2] in {("infra", "aws"), ("infra", "gcp")}:
            continue
        wrong = imports_of(path) & CLOUD_SDKS
        if wrong:
            bad.append(f"{rel} imports {sorted(wrong)}")
    assert not bad, "cloud SDK imported outside infra/aws or infra/gcp:\n" + "\n".join(bad)


def test_rule_detects_a_wrong_arrow(tmp_path: Path) -> None:
    bad = tmp_path / "m.py"
    bad.write_text("import prefect\nfrom flows.x import y\n")
    assert imports_of(bad) & FORBIDDEN["sailor_core"] == {"prefect", "flows"}
