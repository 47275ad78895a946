"""binder/: what repo2docker installs is enough to run the notebooks (the package with its notebook
extra, every environment, Python 3.11), with paths that resolve from the repository root, where
repo2docker runs pip."""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BINDER = ROOT / "binder"


def requirement_lines() -> list[str]:
    lines = (BINDER / "requirements.txt").read_text().splitlines()
    return [line.split("#", 1)[0].strip() for line in lines if line.split("#", 1)[0].strip()]


def editable_paths() -> dict[str, str]:
    """Local path (with extras) -> path, of every `-e PATH` line."""
    found = {}
    for line in requirement_lines():
        match = re.fullmatch(r"-e\s+(\S+)", line)
        if match:
            found[match.group(1)] = re.sub(r"\[.*\]$", "", match.group(1))
    return found


def test_requirements_install_the_package_with_its_notebook_extra():
    assert ".[notebook]" in editable_paths()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    names = {re.split(r"[<>=\[ ]", d)[0] for d in extras["notebook"]}
    assert {"ipykernel", "ipywidgets", "papermill", "nbconvert", "matplotlib"} <= names


def test_requirements_install_every_environment_from_the_repository_root():
    paths = editable_paths().values()
    for path in paths:  # relative to the root, where repo2docker runs pip
        assert path.startswith("."), f"{path}: use a path relative to the repository root"
        assert (ROOT / path / "pyproject.toml").is_file(), f"{path} is not an installable folder"
    listed = {(ROOT / path).resolve() for path in paths}
    environments = {p.parent.resolve() for p in (ROOT / "environments").glob("*/pyproject.toml")}
    assert environments and environments <= listed, sorted(map(str, environments - listed))


def test_torch_is_the_cpu_build_and_no_other_index_is_named():
    """Binder has no GPU: torch comes from PyTorch's CPU wheel index (the Makefile's TORCH_INDEX),
    at the Makefile's pin; no other index or link source is named."""
    makefile = (ROOT / "Makefile").read_text()
    index = re.search(r"^TORCH_INDEX\s*\?=\s*(\S+)", makefile, re.M).group(1)
    pin = re.search(r"^TORCH\s*\?=\s*torch==(\S+)", makefile, re.M).group(1)
    lines = requirement_lines()
    assert f"--extra-index-url {index}" in lines
    assert f"torch=={pin}+cpu" in lines
    for line in lines:
        if line != f"--extra-index-url {index}":
            assert not line.startswith(("-i", "--index-url", "--extra-index-url", "-f",
                                        "--find-links")), line
            assert "://" not in line, line


def test_runtime_is_python_3_11():
    assert (BINDER / "runtime.txt").read_text().strip() == "python-3.11"


def test_post_build_when_present_is_executable():
    post_build = BINDER / "postBuild"
    assert not post_build.exists() or os.access(post_build, os.X_OK)
