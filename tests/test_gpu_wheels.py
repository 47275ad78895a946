"""bench/gpu_wheels.py and bench/gpu_check.sh's offline bootstrap: a GPU host's python that
lacks some of astranb's dependencies gets them from wheels copied along, unpacked into a scratch
folder."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_wheels  # noqa: E402


def fake_wheel(folder: Path, name: str, version: str, module: str) -> Path:
    """A minimal valid wheel: one module that records its version, and its dist-info."""
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{module}/__init__.py", f"VERSION = {version!r}\n")
        archive.writestr(f"{info}/METADATA",
                         f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        archive.writestr(f"{info}/WHEEL",
                         "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr(f"{info}/RECORD", "")
    return path


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> str:
    """An interpreter with nothing but the standard library (a venv without pip)."""
    where = tmp_path_factory.mktemp("bare")
    venv.EnvBuilder(with_pip=False).create(where)
    return str(where / "bin" / "python")


def test_wheel_names_parse_as_pip_reads_them():
    assert gpu_wheels.wheel_distribution(Path(
        "pydantic_core-2.41.5-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl")) \
        == ("pydantic-core", "2.41.5")
    assert gpu_wheels.wheel_distribution(Path("typing_extensions-4.15.0-py3-none-any.whl")) \
        == ("typing-extensions", "4.15.0")
    assert gpu_wheels.wheel_distribution(Path("foo-1.0-1build-py3-none-any.whl")) == ("foo", "1.0")
    assert gpu_wheels.canonical("Typing_Extensions") == gpu_wheels.canonical("typing.extensions")
    with pytest.raises(ValueError, match="not a wheel"):
        gpu_wheels.wheel_distribution(Path("fastapi-0.115.0.tar.gz"))


def test_only_what_the_host_lacks_and_the_newest_of_two():
    wheels = [Path(n) for n in ("fastapi-0.115.0-py3-none-any.whl",
                                "Starlette-0.9.0-py3-none-any.whl",
                                "starlette-0.10.1-py3-none-any.whl",
                                "anyio-4.4.0-py3-none-any.whl")]
    chosen = gpu_wheels.missing_wheels(wheels, installed={"anyio"})
    assert [p.name for p in chosen] == ["fastapi-0.115.0-py3-none-any.whl",
                                        "starlette-0.10.1-py3-none-any.whl"]  # 0.10 > 0.9
    assert gpu_wheels.missing_wheels(wheels, {"fastapi", "starlette", "anyio"}) == []


def test_a_wheel_that_would_write_outside_the_folder_is_refused(tmp_path):
    path = tmp_path / "evil-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("../escaped.py", "")
    with pytest.raises(ValueError, match="outside"):
        gpu_wheels.unpack([path], tmp_path / "site")
    assert not (tmp_path / "escaped.py").exists()


def test_a_bare_python_imports_what_it_lacked_and_keeps_what_it_has(tmp_path, bare_python):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    fake_wheel(wheels, "astranb_probe_a", "1.2", "astranb_probe_a")
    fake_wheel(wheels, "astranb_probe_b", "3.4", "astranb_probe_b")
    site = tmp_path / "site"
    done = subprocess.run([bare_python, str(ROOT / "bench" / "gpu_wheels.py"), "install",
                           str(wheels), str(site)], capture_output=True, text=True, check=True)
    assert "unpacked 2 wheels" in done.stdout
    probe = "import astranb_probe_a as a, astranb_probe_b as b; print(a.VERSION, b.VERSION)"
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([bare_python, "-c", probe], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert out.split() == ["1.2", "3.4"]
    # run again with the unpacked ones on the path: the interpreter now has both, nothing to do
    again = subprocess.run([bare_python, str(ROOT / "bench" / "gpu_wheels.py"), "install",
                            str(wheels), str(tmp_path / "site2")], env=env, capture_output=True,
                           text=True, check=True)
    assert "unpacked 0 wheels" in again.stdout


def test_the_check_says_how_to_get_the_wheels_when_they_are_missing(tmp_path, bare_python):
    env = {**os.environ, "GPU_CHECK_PYTHON": bare_python,
           "GPU_CHECK_WHEELS": str(tmp_path / "absent")}
    done = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), str(tmp_path / "r.json")],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "make gpu-wheels" in done.stderr
    assert not (tmp_path / "r.json").exists()


def test_an_empty_wheel_folder_is_a_clear_error(tmp_path, bare_python):
    (tmp_path / "empty").mkdir()
    done = subprocess.run([bare_python, str(ROOT / "bench" / "gpu_wheels.py"), "install",
                           str(tmp_path / "empty"), str(tmp_path / "site")],
                          capture_output=True, text=True)
    assert done.returncode != 0 and "make gpu-wheels" in done.stderr
