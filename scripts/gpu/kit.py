"""Build the GPU check's kit: what the device image lacks, in one git-ignored folder.

    scripts/gpu/kit.sh [--dest .gpu-kit] [--limit-mib 64]

The device machine (docs/testing.md, "The GPU check") has Python 3.12, torch, onnx and
onnxruntime, but no network and no cffi: Horovod cannot be built there from what the image
holds. The kit carries the rest, for ``scripts/gpu/check.sh`` to install offline:

- ``horovod-<version>.tar.gz``: the source ``scripts/build_horovod.sh`` builds on the device;
- ``wheels/``: cp312 manylinux wheels of what that build needs and the image lacks (cffi and
  pycparser: Horovod's ``setup_requires`` under PyTorch; cmake 3.31: gloo's CMakeLists refuse
  the image's cmake 4) and of every distribution the trainer imports (or its ``trainer`` extra
  names) that ``scripts/gpu/device-packages.txt`` does not list, with their dependencies, at
  the versions of ``requirements/lock.txt``;
- ``kit.json``: each file's sha256, size and why it is there, and the travelling tree's size.

The device tool copies the working tree (tracked files, untracked files git does not ignore)
and the carried kit, 64 MiB in all: the kit prints that total and exits 1 over the limit.

Cached by content: the downloads are keyed by what is asked for (the requests, the target
platform, the device's package list) under ``$HVA_GPU_KIT_CACHE`` (default
``~/.cache/horovod-airflow/gpu-kit``); a rerun whose files still match their sha256 downloads
nothing.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DEVICE_PACKAGES = REPO / "scripts" / "gpu" / "device-packages.txt"
LOCK = REPO / "requirements" / "lock.txt"
PYPROJECT = REPO / "pyproject.toml"
#: What a rank runs: the trainer and the core it imports (horovod_airflow.core: storage is boto3).
RANK_CODE = (REPO / "trainer", REPO / "core")
HOROVOD_VERSION = "0.28.1"
# gloo's CMakeLists (in Horovod 0.28.1) ask for a cmake_minimum_required that cmake 4 refuses.
CMAKE_VERSION = "3.31.10"
# Horovod's setup_requires when it builds for PyTorch: cffi (and cffi's pycparser).
BUILD_NEEDS = ("cffi", "pycparser")
PYTHON_VERSION = "3.12"  # the device's Python (3.12.3)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
LIMIT_MIB = 64.0
KIT_FORMAT = 1
SIZE_FILE = "size.json"  # the travelling tree's size when the kit was last built
MIB = 1024 * 1024


class KitError(RuntimeError):
    """The kit cannot be built (a download failed, the tree is over the limit, ...)."""


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def device_packages(path: Path = DEVICE_PACKAGES) -> set[str]:
    names = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return {normalize(n) for n in names if n}


def trainer_imports(folders: tuple[Path, ...] = RANK_CODE) -> set[str]:
    """Top-level names of the modules a rank's code (the trainer and the core) imports, the
    standard library and the project itself left out (imports inside functions included: they
    run too)."""
    found: set[str] = set()
    for path in sorted(p for folder in folders for p in folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    own = {"horovod_airflow", "__future__"}
    return {m for m in found if m not in sys.stdlib_module_names and m not in own}


def distributions_of(modules: set[str]) -> dict[str, str]:
    """module -> the distribution that installs it here (this interpreter must have the
    trainer's dependencies: the project's .venv)."""
    installed = importlib.metadata.packages_distributions()
    out = {}
    for module in sorted(modules):
        dists = installed.get(module)
        if not dists:
            raise KitError(
                f"the trainer imports {module!r}, which this interpreter ({sys.executable}) "
                "does not have: run the kit with the project's .venv (scripts/setup.sh)"
            )
        out[module] = dists[0]
    return out


def trainer_extra(pyproject: Path = PYPROJECT) -> set[str]:
    """The distributions of pyproject's ``trainer`` extra (onnxscript: torch's ONNX export
    needs it, though no trainer line imports it)."""
    extra = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]["trainer"]
    out = set()
    for requirement in extra:
        match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
        if match:
            out.add(match.group(0))
    return out


def lock_pins(lock: Path = LOCK) -> dict[str, str]:
    pins = {}
    for line in lock.read_text().splitlines():
        match = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)", line)
        if match:
            pins[normalize(match.group(1))] = match.group(2)
    return pins


def missing_on_device(device: set[str]) -> dict[str, str]:
    """Distributions the trainer needs that the device lacks -> why (Horovod excepted: the
    check builds it from the sdist)."""
    needed = {dist: f"the trainer imports {module}" for module, dist in
              distributions_of(trainer_imports()).items()}  # fmt: skip
    for dist in trainer_extra():
        needed.setdefault(dist, "pyproject's trainer extra")
    return {
        normalize(d): why
        for d, why in sorted(needed.items())
        if normalize(d) not in device and normalize(d) != "horovod"
    }


def requests(device: set[str]) -> dict[str, Any]:
    """What the kit asks the package index for; its hash is the cache key."""
    pins = lock_pins()
    missing = missing_on_device(device)
    for dist in [*BUILD_NEEDS, *missing]:
        if normalize(dist) not in pins:
            raise KitError(f"{dist} is not pinned in {LOCK.relative_to(REPO)}")
    return {
        "format": KIT_FORMAT,
        "python": PYTHON_VERSION,
        "platforms": list(PLATFORMS),
        "sdist": f"horovod=={HOROVOD_VERSION}",
        "build_wheels": [f"{d}=={pins[d]}" for d in BUILD_NEEDS] + [f"cmake=={CMAKE_VERSION}"],
        "runtime": {f"{d}=={pins[d]}": why for d, why in missing.items()},
        "device_packages": sorted(device),
        "pins": {d: v for d, v in sorted(pins.items())},  # the deps resolve against the lock
    }


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def pip(args: list[str]) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise KitError(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")


def wheel_name(path: Path) -> str:
    return normalize(path.name.split("-")[0])


def download(req: dict[str, Any], dest: Path, device: set[str]) -> list[dict[str, Any]]:
    """Fetch the sdist and the wheels into ``dest``; return the kit's file entries."""
    wheels = dest / "wheels"
    target = ["--only-binary=:all:", "--python-version", req["python"], "--implementation", "cp"]
    for platform in req["platforms"]:
        target += ["--platform", platform]
    pip(["--no-deps", "--no-binary", ":all:", req["sdist"], "-d", str(dest)])
    pip(["--no-deps", *target, *req["build_wheels"], "-d", str(wheels)])
    why: dict[str, str] = {}
    for spec in req["build_wheels"]:
        name = normalize(spec.split("==")[0])
        why[name] = (
            f"build: cmake {CMAKE_VERSION} (the image's cmake 4 refuses gloo's CMakeLists)"
            if name == "cmake"
            else f"build: Horovod's setup_requires under PyTorch ({', '.join(BUILD_NEEDS)})"
        )
    if req["runtime"]:
        constraints = dest / "constraints.txt"
        constraints.write_text("".join(f"{d}=={v}\n" for d, v in req["pins"].items()))
        pip([*target, "-c", str(constraints), *req["runtime"], "-d", str(wheels)])
        constraints.unlink()
        for spec, reason in req["runtime"].items():
            why[normalize(spec.split("==")[0])] = f"run: {reason}"
        for whl in sorted(wheels.glob("*.whl")):
            name = wheel_name(whl)
            if name in why:
                continue
            if name in device:  # a dependency the image already has
                whl.unlink()
            else:
                why[name] = "run: a dependency of " + ", ".join(
                    s.split("==")[0] for s in req["runtime"]
                )
    entries = []
    for path in sorted(p for p in dest.rglob("*") if p.is_file()):
        rel = path.relative_to(dest).as_posix()
        reason = (
            "build: the Horovod source scripts/build_horovod.sh builds on the device"
            if rel.endswith(".tar.gz")
            else why.get(wheel_name(path), "")
        )
        if not reason:
            raise KitError(f"{rel}: downloaded but not asked for")
        entries.append({"path": rel, "bytes": path.stat().st_size, "sha256": sha256(path),
                        "why": reason})  # fmt: skip
    return entries


def verified(folder: Path, key: str) -> dict[str, Any] | None:
    """The folder's kit.json when it is this key's and every file matches its sha256."""
    try:
        manifest: dict[str, Any] = json.loads((folder / "kit.json").read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("key") != key:
        return None
    for entry in manifest["files"]:
        path = folder / entry["path"]
        if not path.is_file() or path.stat().st_size != entry["bytes"]:
            return None
        if sha256(path) != entry["sha256"]:
            return None
    listed = {e["path"] for e in manifest["files"]} | {"kit.json", SIZE_FILE}
    present = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    return manifest if present <= listed else None


def cache_root() -> Path:
    root = os.environ.get("HVA_GPU_KIT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
        "horovod-airflow",
        "gpu-kit",
    )
    return Path(root)


def cached_downloads(req: dict[str, Any], key: str, device: set[str]) -> tuple[Path, bool]:
    """The cache folder of ``key``, downloaded when missing or damaged; (folder, was cached)."""
    folder = cache_root() / key[:16]
    if verified(folder, key):
        return folder, True
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        files = download(req, tmp, device)
        manifest = {"key": key, "requests": req, "files": files}
        (tmp / "kit.json").write_text(json.dumps(manifest, indent=1) + "\n")
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder, False


def place(source: Path, dest: Path) -> None:
    """Make ``dest`` hold the kit of ``source`` (hard links where possible)."""
    shutil.rmtree(dest, ignore_errors=True)
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        target = dest / path.relative_to(source)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, target)
        except OSError:
            shutil.copy2(path, target)


def tree_bytes(repo: Path, kit: Path) -> dict[str, int]:
    """What the device tool copies: tracked files, untracked files git does not ignore, and
    the kit (carried). Links count as links."""

    def listed(*args: str) -> int:
        out = subprocess.run(
            ["git", "-C", str(repo), "ls-files", "-z", *args],
            capture_output=True, check=True,
        ).stdout  # fmt: skip
        total = 0
        for name in filter(None, out.decode().split("\0")):
            with contextlib.suppress(FileNotFoundError):  # deleted here: it does not travel
                total += (repo / name).lstat().st_size
        return total

    kit_bytes = sum(p.lstat().st_size for p in kit.rglob("*") if p.is_file())
    parts = {
        "tracked": listed("--cached"),
        "untracked": listed("--others", "--exclude-standard"),
        "kit": kit_bytes,
    }
    parts["total"] = sum(parts.values())
    return parts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dest", type=Path, default=REPO / ".gpu-kit", help="default .gpu-kit")
    parser.add_argument(
        "--limit-mib", type=float, default=LIMIT_MIB,
        help="the device's limit on the travelling tree (default %(default)s)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        device = device_packages()
        req = requests(device)
        key = hashlib.sha256(json.dumps(req, sort_keys=True).encode()).hexdigest()
        if verified(args.dest, key):
            state = "already in place: every file matches its sha256"
        else:
            source, was_cached = cached_downloads(req, key, device)
            place(source, args.dest)
            state = "placed from the cache" if was_cached else "downloaded and placed"
    except KitError as e:
        print(f"kit: ERROR: {e}", file=sys.stderr)
        return 1
    manifest = json.loads((args.dest / "kit.json").read_text())
    print(f"kit: {args.dest} (key {key[:16]}, {state})")
    for entry in manifest["files"]:
        print(f"kit:   {entry['path']:<72} {entry['bytes'] / MIB:6.2f} MiB  {entry['why']}")
    sizes = tree_bytes(REPO, args.dest)
    limit = args.limit_mib * MIB
    print(
        "kit: travelling tree: "
        + " + ".join(f"{k} {sizes[k] / MIB:.2f} MiB" for k in ("tracked", "untracked", "kit"))
        + f" = {sizes['total'] / MIB:.2f} MiB of {args.limit_mib:g} MiB "
        f"({(limit - sizes['total']) / MIB:.2f} MiB left); {time.perf_counter() - start:.1f} s"
    )
    (args.dest / SIZE_FILE).write_text(json.dumps({**sizes, "limit": int(limit)}, indent=1) + "\n")
    if sizes["total"] > limit:
        print(
            f"kit: ERROR: the travelling tree is {sizes['total'] / MIB:.2f} MiB, over the "
            f"device's {args.limit_mib:g} MiB: ignore or remove untracked files, or carry less",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
