"""README's "AMD: what is checked" stays true to what setup.py and CI use: every default ROCm
arch and every arch CI compiles has its row, and the minimum torch and ROCm it states are
setup.py's."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def constants(path: Path) -> dict[str, object]:
    """The module-level constant assignments of a file, without running it."""
    found = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name):
                try:
                    found[target.id] = ast.literal_eval(node.value)
                except ValueError:
                    pass
    return found


def amd_section() -> str:
    text = (ROOT / "README.md").read_text()
    return text.split("## AMD: what is checked", 1)[1].split("\n## ", 1)[0]


def test_every_arch_has_a_row():
    setup = constants(ROOT / "setup.py")
    report = constants(ROOT / "tools" / "kernel_report.py")
    ci_archs = re.search(r"check-hip\.sh ((?:gfx\w+ ?)+)", (ROOT / ".ci" / "run").read_text())
    archs = set(setup["DEFAULT_ROCM_ARCHS"].split(";")) | set(report["AMD_ARCHS"])
    archs |= set(ci_archs.group(1).split())
    rows = set(re.findall(r"^\| (gfx\w+) \|", amd_section(), re.M))
    assert archs <= rows, f"README's AMD matrix lacks {sorted(archs - rows)}"


def test_minimum_versions_are_setups():
    setup = constants(ROOT / "setup.py")
    torch_min = ".".join(map(str, setup["MIN_TORCH"]))
    rocm_min = ".".join(map(str, setup["MIN_ROCM"]))
    readme = (ROOT / "README.md").read_text()
    assert f"torch >= {torch_min}, built for\n  ROCm >= {rocm_min}" in readme
    assert f"built for ROCm < {rocm_min}" in amd_section()
    assert f'"torch>={torch_min}"' in (ROOT / "pyproject.toml").read_text()


def test_every_torch_row_checked_in_ci_is_built_there():
    """Each torch version the matrix says CI builds is installed by CI (the test venv's, or a venv
    of its own) and built with the hipify generation its row names; a row checked by hand says
    so and names the command, which CI's header names too."""
    ci = (ROOT / ".ci" / "run").read_text()
    venv = (ROOT / "tools" / "venv.sh").read_text()
    row = r"^\| (\d+\.\d+\.\d+) \(as ROCm [\d.]+\) \| (v[12]) [^|]*\| ([^|]*) \|$"
    rows = re.findall(row, amd_section(), re.M)
    assert {gen for _, gen, _ in rows} == {"v1", "v2"}, rows
    for version, generation, checked in rows:
        if checked.startswith("by hand"):
            command = f"QWEN4EXP_EXPECT_HIPIFY={generation} tools/check-rocm-build.sh"
            assert command in checked and command in ci, f"torch {version}: no command to run"
            continue
        assert f"torch=={version}" in ci + venv, f"CI installs no torch {version}"
        assert f"QWEN4EXP_EXPECT_HIPIFY={generation}" in ci, f"CI builds no hipify {generation}"
    assert any(not checked.startswith("by hand") for _, _, checked in rows), "CI builds no torch"
