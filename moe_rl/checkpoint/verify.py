"""What a checkpoint must be before a resume or an export trusts it.

At commit, ``meta.json`` gets a manifest: every file under ``dist/``, ``rng/``, ``hf/`` and
(where the checkpoint has its HF weights) ``model/`` with its size and CRC-32. Each rank's background writer sums the ``.distcp`` files it has
just written (read back while they are in the page cache, in the writer process, so
training does not wait); the first rank sums the small files at commit. ``meta.json``
also gets a seal: a hash of everything else in it (step, fingerprint, layout, the
manifest), so an edited step or fingerprint no longer matches the data it describes.

Verification: the seal, every file's size, and the checksums, each file summed by one
rank (round robin), so a resume on N ranks reads the checkpoint once more, split N ways.
A checkpoint written before manifests existed is checked for its files' presence and for
the ``.distcp`` sizes its ``dist/.metadata`` implies, with a warning that its contents are
not verified. A resume and ``moe-rl export`` verify what they read (``dist/``, ``rng/``,
``hf/``); ``eval`` and ``drift``, which read ``model/``, verify that (:func:`model_files_problem`).
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from moe_rl.disk import space_error

SUMMED = ("dist", "rng", "hf", "model", "rollout")  # the folders the manifest covers
TRAINING_STATE = ("dist", "rng", "hf", "rollout")  # what a resume (and an export) reads of them
ROLLOUT_CARRY = "rollout/carry.pt"  # partial rollouts: the responses carried into the next step
SUMS = "sums"  # the writers' reports in a temporary checkpoint, merged into meta.json at commit
_CHUNK = 8 << 20
_THREADS = 4  # zlib.crc32 and file reads release the GIL


def file_sum(path: Path) -> tuple[int, int]:
    """``(size, CRC-32)`` of a file, read once in chunks (a small file's buffer is its
    own size, not a whole chunk: the many small files summed at commit stay cheap)."""
    with open(path, "rb", buffering=0) as f:
        crc, size, buf = 0, 0, bytearray(min(_CHUNK, os.fstat(f.fileno()).st_size + 1))
        view = memoryview(buf)
        while n := f.readinto(buf):
            crc, size = zlib.crc32(view[:n], crc), size + n
    return size, crc


def sum_files(root: Path, names: list[str]) -> dict[str, list[int]]:
    """``{name: [size, crc]}`` of ``root / name`` for each name, a few files at a time."""
    if not names:
        return {}
    with ThreadPoolExecutor(min(_THREADS, len(names))) as pool:
        sums = pool.map(lambda name: list(file_sum(root / name)), names)
        return dict(zip(names, sums))


def summing_writer(write: Callable, tmp: Path, rank: int) -> Callable:
    """megatron's background write function (``write(rank, write_buckets, queue)``)
    followed, in the same writer process, by the sums of the files it wrote, to
    ``tmp/sums/rank_<rank>.json`` (the trainer sees the writer done when it exits)."""

    def write_and_sum(*args: Any, **kwargs: Any) -> None:
        # megatron's write runs with the garbage collector off (in a forked writer a
        # collection may free the parent's CUDA tensors): the sums after it keep it off
        enabled = gc.isenabled()
        gc.disable()
        try:
            write(*args, **kwargs)
            _report_sums(args[1], tmp, rank)
        finally:
            if enabled:
                gc.enable()

    return write_and_sum


def _report_sums(write_buckets: Any, tmp: Path, rank: int) -> None:
    """The sums of the files a writer wrote, into ``tmp/sums/rank_<rank>.json``."""
    files = [Path(bucket[0]) for bucket in write_buckets]
    report = sum_files(tmp / "dist", [p.name for p in files if p.is_file()])
    _write_report({f"dist/{name}": s for name, s in report.items()}, tmp, f"rank_{rank:05d}.json")


def report_model_sums(tmp: Path, rank: int, world_size: int) -> None:
    """Every rank: the sums of its share (round robin) of ``tmp/model``'s files, into
    ``tmp/sums/model_rank_<rank>.json``, so the commit does not read the export back alone
    (tens of GB on one rank, the others waiting)."""
    folder = tmp / "model"
    names = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())[rank::world_size]
    report = sum_files(folder, names)
    _write_report({f"model/{name}": s for name, s in report.items()}, tmp, f"model_rank_{rank:05d}.json")


def _write_report(report: dict[str, list[int]], tmp: Path, name: str) -> None:
    """``report`` as ``tmp/sums/<name>``, whole or not at all (written aside, then renamed)."""
    part = tmp / SUMS / f".{name}"
    try:
        with open(part, "w") as f:
            json.dump(report, f)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        if space_error(e) is None:
            raise
        # a full disk: the trainer, told by the write's own result or by its commit, says so
        part.unlink(missing_ok=True)
        return
    part.rename(part.with_name(part.name[1:]))


def manifest_of(tmp: Path) -> dict[str, list[int]]:
    """First rank, at commit: the writers' and exporters' reports and the sums of every other
    file the manifest covers (a file no rank reported is summed here)."""
    reported: dict[str, list[int]] = {}
    for report in sorted([*(tmp / SUMS).glob("rank_*.json"), *(tmp / SUMS).glob("model_rank_*.json")]):
        reported.update(json.loads(report.read_text()))
    files = sorted(
        str(p.relative_to(tmp)) for folder in SUMMED if (tmp / folder).is_dir() for p in (tmp / folder).rglob("*")
    )
    # a reported file the listing lacks (a network file system's stale directory cache)
    # is looked up by name; one that is not there is a checkpoint that must not be sealed
    files = sorted({f for f in files if (tmp / f).is_file()} | set(reported))
    missing = [f for f in reported if not (tmp / f).is_file()]
    if missing:
        raise RuntimeError(f"{tmp}: files the checkpoint writers reported are missing: {', '.join(missing[:5])}")
    manifest = {**sum_files(tmp, [f for f in files if f not in reported]), **reported}
    return {f: manifest[f] for f in files}


def seal_of(meta: dict) -> str:
    """A hash of ``meta`` without its seal (keys sorted)."""
    body = json.dumps({k: v for k, v in meta.items() if k != "seal"}, sort_keys=True)
    return hashlib.blake2b(body.encode(), digest_size=16).hexdigest()


def sealed(meta: dict, manifest: dict[str, list[int]]) -> dict:
    """``meta`` with the manifest and the seal over both."""
    meta = {**meta, "manifest": manifest}
    return {**meta, "seal": seal_of(meta)}


def seal_problem(meta: dict) -> str | None:
    """Why ``meta`` no longer matches its seal (``None``: it does, or it has none)."""
    if "seal" in meta and meta.get("seal") != seal_of(meta):
        return "meta.json does not match its seal (edited or damaged after the commit: its step/fingerprint are not the data's)"
    if "seal" in meta and not isinstance(meta.get("manifest"), dict):
        return "meta.json's manifest is missing"
    return None


def verification_problem(path: Path, meta: dict, share: tuple[int, int]) -> str | None:
    """Why the checkpoint at ``path``'s training state (``TRAINING_STATE``) is not what its
    sealed ``meta`` records: this rank (``share``: rank, world size) checks every file's size
    and sums its share of them."""
    problem = seal_problem(meta)
    if problem or "seal" not in meta:
        return problem or _unsealed_problem(path)
    return _files_problem(path, meta["manifest"], TRAINING_STATE, share)


def model_files_problem(path: Path, meta: dict) -> str | None:
    """Why the checkpoint at ``path``'s ``model/`` files are not what its sealed ``meta``'s
    manifest records (every one's size and CRC-32, summed here); ``None`` also when the
    manifest has no entry for them (a checkpoint committed before it covered ``model/``)."""
    return _files_problem(path, meta.get("manifest") or {}, ("model",), (0, 1))


def _files_problem(path: Path, manifest: dict, folders: tuple[str, ...], share: tuple[int, int]) -> str | None:
    manifest = {name: entry for name, entry in manifest.items() if name.split("/", 1)[0] in folders}
    for name, (size, _) in manifest.items():
        problem = _size_problem(path / name, name, size)
        if problem:
            return problem
    mine = sorted(manifest, key=lambda name: (-manifest[name][0], name))[share[0] :: share[1]]
    try:
        sums = sum_files(path, mine)
    except OSError as e:
        return f"a file cannot be read ({e.strerror or e})"
    for name in mine:
        if sums[name][1] != manifest[name][1]:
            return f"{name} is damaged (its CRC-32 differs from the one recorded at commit)"
    return None


def _size_problem(file: Path, name: str, size: int) -> str | None:
    try:
        actual = file.stat().st_size
    except OSError:
        return f"{name} is missing"
    if actual != size:
        return f"{name} has {actual} bytes, {size} were written"
    return None


def _unsealed_problem(path: Path) -> str | None:
    """A checkpoint without a manifest: its ``dist/`` files readable and as long as its
    ``.metadata`` says (contents unverified)."""
    try:
        json.loads((path / "dist" / "metadata.json").read_text())
    except (OSError, ValueError):
        return "dist/metadata.json is unreadable"
    try:
        from torch.distributed.checkpoint import FileSystemReader

        storage = FileSystemReader(str(path / "dist")).read_metadata().storage_data
    except Exception:  # a damaged pickle raises anything
        return "dist/.metadata is unreadable"
    ends: dict[str, int] = {}
    for info in storage.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        file = path / "dist" / name
        if not file.is_file():
            return f"dist/{name} is missing"
        if file.stat().st_size < end:
            return f"dist/{name} is truncated ({file.stat().st_size} of at least {end} bytes)"
    return None
