"""The distribution installs as one import package, editable and non-editable."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import tomllib

import pytest

REPO = Path(__file__).resolve().parents[2]
ROOTS = {"offload_compile": "hyper_offload", "passes": "hyper_offload.passes", "runtime": "hyper_offload.runtime"}


def _source_packages() -> dict[str, str]:
    """Every package folder of the source tree (one with an ``__init__.py``) -> import name."""
    found = {}
    for root, package in ROOTS.items():
        for init in sorted((REPO / root).rglob("__init__.py")):
            folder = init.parent.relative_to(REPO)
            found[folder.as_posix()] = ".".join([package, *folder.parts[1:]])
    return found


PACKAGES = _source_packages()
IMPORTS = "import " + ", ".join(PACKAGES.values()) + "; print(hyper_offload.__file__)"


def test_pyproject_lists_every_package_folder() -> None:
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert sorted(setuptools["packages"]) == sorted(PACKAGES.values()), (
        "pyproject.toml [tool.setuptools] packages must list every package folder; "
        "a missing one is left out of the wheel"
    )


def _python(code: str, *, cwd: Path, extra_path: Path | None = None) -> str:
    env = dict(os.environ)
    if extra_path is not None:
        env["PYTHONPATH"] = str(extra_path)
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.slow
def test_editable_install_maps_the_three_folders(tmp_path: Path) -> None:
    location = Path(_python(IMPORTS, cwd=tmp_path))
    assert location == REPO / "offload_compile" / "__init__.py"


def _source_copy(destination: Path) -> Path:
    """What a fresh clone has for the build, copied away from the repository.

    Building in the repository itself would leave ``build/`` and ``*.egg-info`` there, and
    setuptools reuses a stale ``build/lib``: a module deleted from the source could still
    be installed and the test would not notice.
    """
    for name in ("pyproject.toml", "README.md"):
        destination.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, destination / name)
    for folder in ROOTS:
        shutil.copytree(REPO / folder, destination / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return destination


@pytest.mark.slow
def test_non_editable_install_works_without_the_source_tree(tmp_path: Path) -> None:
    target = tmp_path / "site"
    source = _source_copy(tmp_path / "src")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(source)],
        capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, build.stderr
    installed = target / "hyper_offload"
    # Exactly the source modules, no more (a stale build would add some) and no fewer.
    for folder, package in PACKAGES.items():
        expected = {p.name for p in (REPO / folder).glob("*.py")}
        installed_folder = target.joinpath(*package.split("."))
        assert {p.name for p in installed_folder.glob("*.py")} == expected, folder
    # Run with the installed copy first on the path and the repo nowhere on it.
    code = "import sys; sys.path.insert(0, %r); " % str(target) + IMPORTS
    location = Path(_python(code, cwd=tmp_path))
    assert location == installed / "__init__.py"
    help_text = _python(
        "import sys; sys.path.insert(0, %r); sys.argv=['hyper-offload','--help']\n"
        "from hyper_offload.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass" % str(target),
        cwd=tmp_path,
    )
    assert "plan" in help_text


@pytest.mark.slow
def test_console_script_is_installed_and_runs(tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "hyper-offload"
    assert script.is_file(), f"{script} missing: the [project.scripts] entry was not installed"
    done = subprocess.run([str(script), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "plan" in done.stdout and "pp-order" in done.stdout
