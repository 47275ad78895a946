"""Wheels for a GPU host with no network: fetched here, unpacked there (make gpu-wheels).

A bare GPU host brings its own Python with CUDA torch, transformers and most of astranb's
dependencies, but not all of them, and cannot reach a package index. So, on a networked machine:

    make gpu-wheels                  # = .venv/bin/python bench/gpu_wheels.py download

downloads, for the host's Python (3.12 unless GPU_HOST_PYTHON says otherwise) and platform
(x86-64 Linux, manylinux), the wheels of what such a host lacks (`HOST_LACKS`, at the versions
this checkout's .venv runs, so the check runs what the tests ran) and their dependencies into
`.gpu-wheels/` (ignored by git; about 10 MB, small enough to copy along with the repo).
On the host, bench/gpu_check.sh then runs, with the host's python and the standard library only,

    python3 bench/gpu_wheels.py install .gpu-wheels SCRATCH

which unpacks into SCRATCH each wheel whose distribution the host does not already have (a wheel
is a zip archive laid out as a site-packages folder; console scripts and `.data` folders are not
needed by the check), and puts SCRATCH and the checkout on PYTHONPATH. Nothing is installed into
the host's own environment, and the host's packages win where it has them.

The install side imports nothing beyond the standard library: it runs before any of astranb's
dependencies can be assumed.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# What a bare GPU host (Python 3.12, CUDA torch, transformers, safetensors, httpx, anyio,
# msgpack, numba, pandas, ...) lacks of astranb's core dependencies (pyproject.toml).
HOST_LACKS = ("zstandard", "fastapi", "uvicorn")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "linux_x86_64")

_WHEEL_NAME = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-[^-]+-[^-]+-[^-]+\.whl$")


# -- names -------------------------------------------------------------------------------------

def canonical(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503): `Typing_Extensions` is
    `typing-extensions`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_distribution(path: Path) -> tuple[str, str]:
    """(canonical distribution name, version) from a wheel's file name (PEP 427)."""
    found = _WHEEL_NAME.match(path.name)
    if not found:
        raise ValueError(f"{path.name} is not a wheel's file name "
                         "(NAME-VERSION-PYTHON-ABI-PLATFORM.whl)")
    return canonical(found["name"]), found["version"]


def installed_distributions() -> set[str]:
    """Canonical names of the distributions this interpreter can already import."""
    return {canonical(d.metadata["Name"]) for d in metadata.distributions() if d.metadata["Name"]}


# -- install (on the GPU host) -----------------------------------------------------------------

def missing_wheels(wheels: list[Path], installed: set[str]) -> list[Path]:
    """The wheels whose distribution is not in `installed`, one per distribution (the newest
    version by file name when a folder holds two)."""
    chosen: dict[str, tuple[tuple, Path]] = {}
    for path in wheels:
        name, version = wheel_distribution(path)
        if name in installed:
            continue
        key = tuple(int(p) if p.isdigit() else p for p in re.split(r"[.+]", version))
        if name not in chosen or _newer(key, chosen[name][0]):
            chosen[name] = (key, path)
    return [path for _, path in sorted(chosen.values(), key=lambda kv: kv[1].name)]


def _newer(a: tuple, b: tuple) -> bool:
    try:
        return a > b
    except TypeError:  # a version with letters against one with digits at the same place
        return str(a) > str(b)


def unpack(wheels: list[Path], target: Path) -> None:
    """Unpack each wheel into `target`, a folder to put on sys.path."""
    target.mkdir(parents=True, exist_ok=True)
    for path in wheels:
        with zipfile.ZipFile(path) as archive:
            for member in archive.namelist():
                if member.startswith("/") or ".." in Path(member).parts:
                    raise ValueError(f"{path.name}: member {member!r} would land outside {target}")
            archive.extractall(target)


def install(folder: Path, target: Path) -> list[str]:
    """Unpack the wheels in `folder` that this interpreter lacks into `target`; their names."""
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"no wheels in {folder}: run `make gpu-wheels` on a networked machine "
                         "and copy the folder along with the checkout")
    todo = missing_wheels(wheels, installed_distributions())
    unpack(todo, target)
    return [p.name for p in todo]


# -- download (on a networked machine) ---------------------------------------------------------

def pinned(names: tuple[str, ...]) -> list[str]:
    """`name==version` at the versions this interpreter has (the checkout's .venv)."""
    pins = []
    for name in names:
        try:
            pins.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            raise SystemExit(f"{name} is not installed in {sys.executable}: run `make setup` "
                             "first (the wheels are pinned to what the tests run)") from None
    return pins


def download(dest: Path, python_version: str) -> list[str]:
    """Download the host's missing wheels and their dependencies into `dest` (cleared first)."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    abi = "cp" + python_version.replace(".", "")
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(dest),
               "--only-binary=:all:", "--python-version", python_version,
               "--implementation", "cp", "--abi", abi, "--abi", "abi3", "--abi", "none"]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    subprocess.run(command + pinned(HOST_LACKS), check=True)
    return sorted(p.name for p in dest.glob("*.whl"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    get = sub.add_parser("download", help="fetch the wheels (networked machine)")
    get.add_argument("--dest", type=Path, default=ROOT / ".gpu-wheels")
    get.add_argument("--python-version", default="3.12", help="the GPU host's Python (X.Y)")
    put = sub.add_parser("install", help="unpack the missing ones (the GPU host)")
    put.add_argument("folder", type=Path)
    put.add_argument("target", type=Path)
    args = parser.parse_args()
    if args.command == "download":
        names = download(args.dest, args.python_version)
        size = sum((args.dest / n).stat().st_size for n in names) / 2**20
        print(f"{len(names)} wheels, {size:.1f} MiB, in {args.dest}:", *names, sep="\n  ")
    else:
        names = install(args.folder, args.target)
        print(f"[gpu-check] unpacked {len(names)} wheels into {args.target}:",
              ", ".join(names) or "none (the host has them all)")


if __name__ == "__main__":
    main()
