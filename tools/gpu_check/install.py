"""What ``tools/gpu_check/run.sh`` installs on a GPU machine with no network, and the wheels it needs.

The lent H200 already holds torch, transformers, numpy, ... (``gpu_check/h200_packages.txt``,
copied from the device's KINDS.md) and lacks a few of moe-rl's packages. ``gpu_check/wheels.json``
(written by ``lock``, run by ``tools/gpu_check/wheels.sh`` where the registry answers) pins those: the
project's dependencies (pyproject.toml) that the machine lacks, less ``LEFT_OUT``, and everything
they need that the machine lacks too, each a wheel for Python 3.12 on linux x86_64 in ``wheels/``.

On the machine (``install``) exactly the locked packages that are not installed there go into a
folder of their own (``pip install --no-deps --target``), which ``gpu_check.sh`` puts on
``PYTHONPATH``: no preinstalled package is replaced or shadowed. A preinstalled package at a version
a locked wheel (or moe-rl itself) does not accept is reported as a conflict, not replaced.

    python -m tools.gpu_check.install plan [--packages LIST]     # dry run: what would be installed
    python -m tools.gpu_check.install install --wheels wheels --target DIR [--report FILE]
    python -m tools.gpu_check.install lock --packages LIST --wheels wheels   # needs the registry
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
LOCK = HERE / "wheels.json"
H200_PACKAGES = HERE / "h200_packages.txt"
# where the wheels are for: the lent H200's python (KINDS.md: Python 3.12.3 on x86-64)
TARGET_ENV = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "extra": "",
}
PLATFORMS = [
    "--only-binary=:all:",
    "--python-version",
    "3.12",
    "--implementation",
    "cp",
    *[f"--platform=manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28)],
    "--platform=manylinux2014_x86_64",
    "--platform=manylinux1_x86_64",
    "--platform=any",
]
# project dependencies the check never imports, and why they stay behind
LEFT_OUT = {
    "deepspeed": "only the multi-node launcher runs it (one GPU starts none); PyPI has no wheel of it, only an sdist",
    "datasets": "only Parquet / saved-dataset prompt sources use it; it pins pyarrow>=24, fsspec and dill",
}
SIZE_LIMIT_MIB = 40  # wheels + the working tree: what travels to the device (64 MiB at most)


def normalize(name: str) -> str:
    """PEP 503's name: lower case, runs of ``-_.`` as one ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_package_list(path: Path) -> dict[str, str | None]:
    """``name``, ``name==version`` or ``name version`` (pip list) per line; ``#`` comments."""
    packages: dict[str, str | None] = {}
    for line in Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith(("Package", "---")):
            continue
        name, _, version = line.replace("==", " ").partition(" ")
        packages[normalize(name)] = version.strip() or None
    return packages


def installed_packages() -> dict[str, str]:
    """This python's distributions (what ``sys.path`` finds) and their versions."""
    from importlib.metadata import distributions

    return {normalize(d.metadata["Name"]): d.version for d in distributions() if d.metadata["Name"]}


def project_requirements() -> list[Requirement]:
    import tomllib

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return [Requirement(r) for r in data["project"]["dependencies"]]


def runtime_requirements(requires: list[str]) -> list[Requirement]:
    """``Requires-Dist`` lines that apply on the target machine without extras."""
    reqs = [Requirement(r) for r in requires]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(TARGET_ENV)]


def accepts(req: Requirement, version: str | None) -> bool | None:
    """Whether ``version`` meets ``req`` (``None``: the version is not known)."""
    if version is None:
        return None
    try:
        return req.specifier.contains(Version(version), prereleases=True)
    except InvalidVersion:
        return None


@dataclass
class Plan:
    install: list[dict] = field(default_factory=list)  # lock entries the machine lacks
    present: dict[str, str | None] = field(default_factory=dict)  # required packages the machine has
    conflicts: list[str] = field(default_factory=list)  # a preinstalled version a requirement refuses
    unchecked: list[str] = field(default_factory=list)  # preinstalled at a version the list does not give
    unmet: list[str] = field(default_factory=list)  # required, neither on the machine nor locked
    left_out: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "install": [f"{e['name']}=={e['version']}" for e in self.install],
            "present": self.present,
            "conflicts": self.conflicts,
            "unchecked": self.unchecked,
            "unmet": self.unmet,
            "left_out": self.left_out,
        }


def make_plan(machine: dict[str, str | None], lock: dict) -> Plan:
    """What to install on a machine holding ``machine`` (name -> version or None), from ``lock``."""
    entries = {normalize(e["name"]): e for e in lock["packages"]}
    plan = Plan(left_out=dict(LEFT_OUT))
    plan.install = [e for name, e in entries.items() if name not in machine]
    will_have = {**{name: e["version"] for name, e in entries.items()}, **machine}
    wanted = [("moe-rl", r) for r in project_requirements() if normalize(r.name) not in LEFT_OUT]
    wanted += [(e["name"], r) for e in plan.install for r in runtime_requirements(e["requires"])]
    for who, req in wanted:
        name = normalize(req.name)
        if name not in will_have:
            plan.unmet.append(f"{who} needs {req}: neither on the machine nor in {LOCK.relative_to(ROOT)}")
            continue
        if name in machine:
            plan.present[name] = machine[name]
        verdict = accepts(req, will_have[name])
        if verdict is False:
            plan.conflicts.append(
                f"{who} needs {req}, the machine has {will_have[name]} (left as it is: nothing preinstalled is replaced)"
            )
        elif verdict is None:
            plan.unchecked.append(f"{who} needs {req}: the list gives no version of {name}")
    return plan


def print_plan(plan: Plan, wheels: Path | None = None) -> None:
    print(f"[gpu_check] would install (pip --no-deps, into a folder of their own): {len(plan.install)} wheels")
    for entry in plan.install:
        where = "" if wheels is None else ("" if (wheels / entry["file"]).exists() else "  (NOT in wheels/)")
        print(f"  {entry['file']}  {entry['bytes'] / 2**20:.2f} MiB{where}")
    kept = ", ".join(f"{name} {version or '?'}" for name, version in sorted(plan.present.items()))
    print(f"[gpu_check] already there (kept): {kept}")
    for line in plan.conflicts + plan.unmet:
        print(f"[gpu_check] PROBLEM: {line}")
    for line in plan.unchecked:
        print(f"[gpu_check] checked on the machine: {line}")
    for name, why in plan.left_out.items():
        print(f"[gpu_check] left out: {name}: {why}")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def install(plan: Plan, wheels: Path, target: Path) -> dict:
    """Install ``plan.install`` from ``wheels`` into a fresh ``target``; a report."""
    start = time.perf_counter()
    files, bad = [], []
    for entry in plan.install:
        path = wheels / entry["file"]
        if not path.exists():
            bad.append(f"{entry['file']} is not in {wheels} (run tools/gpu_check/wheels.sh and carry wheels/)")
        elif sha256(path) != entry["sha256"]:
            bad.append(f"{entry['file']} differs from the lock (run tools/gpu_check/wheels.sh again)")
        else:
            files.append(str(path))
    code, tail = 0, ""
    if files:
        subprocess.run(["rm", "-rf", str(target)], check=False)
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        done = subprocess.run(
            [*pip, "--no-cache-dir", "--target", str(target), *files], capture_output=True, text=True, timeout=120
        )
        code, tail = done.returncode, (done.stdout + done.stderr)[-1500:]
    return {
        **plan.as_dict(),
        "installed": [Path(f).name for f in files] if code == 0 else [],
        "missing_wheels": bad,
        "pip_exit": code,
        "pip_output": tail,
        "target": str(target),
        "seconds": round(time.perf_counter() - start, 1),
    }


def tree_bytes() -> int:
    """What travels besides carried paths: tracked and untracked-not-ignored files."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    paths = [ROOT / p for p in listed.decode().split("\0") if p]
    return sum(p.stat().st_size for p in paths if p.is_file())


def wheel_requires(path: Path) -> list[str]:
    with zipfile.ZipFile(path) as whl:
        (meta,) = [n for n in whl.namelist() if n.endswith(".dist-info/METADATA")]
        text = whl.read(meta).decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def download(spec: str, wheels: Path) -> Path:
    """``pip download --no-deps`` of one wheel for the target machine; its path."""
    before = set(wheels.glob("*.whl"))
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLATFORMS, "-d", str(wheels), spec],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"gpu_wheels: pip download {spec} failed:\n{done.stderr[-1500:]}")
    name = normalize(Requirement(spec).name)
    new = [p for p in set(wheels.glob("*.whl")) - before] or [
        p for p in wheels.glob("*.whl") if normalize(p.name.split("-")[0]) == name
    ]
    (path,) = [p for p in new if normalize(p.name.split("-")[0]) == name]
    return path


def pinned(req: Requirement, here: dict[str, str]) -> str:
    """``req`` pinned to the version this python has (what the test suite runs) where it fits."""
    version = here.get(normalize(req.name))
    return f"{req.name}=={version}" if accepts(req, version) else f"{req.name}{req.specifier}"


def lock(machine: dict[str, str | None], wheels: Path) -> dict:
    """Download what ``machine`` lacks (the project's dependencies and theirs); the lock."""
    wheels.mkdir(exist_ok=True)
    here = installed_packages()
    queue = [r for r in project_requirements() if normalize(r.name) not in LEFT_OUT]
    entries: dict[str, dict] = {}
    while queue:
        req = queue.pop(0)
        name = normalize(req.name)
        if name in machine or name in entries or name in LEFT_OUT:
            continue
        path = download(pinned(req, here), wheels)
        requires = wheel_requires(path)
        entries[name] = {
            "name": req.name,
            "version": path.name.split("-")[1],
            "file": path.name,
            "sha256": sha256(path),
            "bytes": path.stat().st_size,
            "requires": [str(r) for r in runtime_requirements(requires)],
        }
        queue += runtime_requirements(requires)
    keep = {e["file"] for e in entries.values()}
    for stale in wheels.glob("*.whl"):
        if stale.name not in keep:
            stale.unlink()
    return {
        "python": TARGET_ENV["python_full_version"],
        "machine_list": H200_PACKAGES.name,
        "packages": list(entries.values()),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("action", choices=("plan", "install", "lock"))
    p.add_argument("--packages", type=Path, help="the machine's package list (default: this python's own)")
    p.add_argument("--wheels", type=Path, default=ROOT / "wheels")
    p.add_argument("--target", type=Path, default=Path("/tmp/gpu_check_site"))
    p.add_argument("--report", type=Path, help="install: write the report (JSON) here")
    args = p.parse_args(argv)
    machine = read_package_list(args.packages) if args.packages else installed_packages()
    if args.action == "lock":
        data = lock(machine, args.wheels)
        LOCK.write_text(json.dumps(data, indent=1) + "\n")
        wheels_bytes = sum(e["bytes"] for e in data["packages"])
        total = (wheels_bytes + tree_bytes()) / 2**20
        print(f"[gpu_wheels] {len(data['packages'])} wheels, {wheels_bytes / 2**20:.1f} MiB in {args.wheels}")
        print(f"[gpu_wheels] with the working tree {total:.1f} MiB travel (limit {SIZE_LIMIT_MIB} MiB)")
        print_plan(make_plan(machine, data), args.wheels)
        return 0 if total <= SIZE_LIMIT_MIB else 1
    plan = make_plan(machine, json.loads(LOCK.read_text()))
    if args.action == "plan":
        print_plan(plan, args.wheels)
        return 0
    report = install(plan, args.wheels, args.target)
    if args.report:
        args.report.write_text(json.dumps(report, indent=1))
    print(
        f"[gpu_check] installed {len(report['installed'])} of {len(plan.install)} wheels into {args.target} "
        f"in {report['seconds']} s; kept {len(plan.present)} preinstalled"
    )
    for line in report["missing_wheels"] + plan.conflicts + plan.unmet:
        print(f"[gpu_check] PROBLEM: {line}")
    return report["pip_exit"]


if __name__ == "__main__":
    sys.exit(main())
