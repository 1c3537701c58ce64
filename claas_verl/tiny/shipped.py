"""Bundles shipped in the repository, so every machine trains from the same weights without a 40-minute build.

A shipped bundle is a ``.tar.gz`` of a built bundle folder in ``benchmarks/bundles/`` with a JSON beside it
(``<name>.json``: ``fingerprint``, ``version``, ``seed``, how it was built). :func:`unpack_shipped` extracts it
into a new folder and checks the extracted files' :func:`~claas_verl.tiny.fingerprint.bundle_fingerprint` against
the JSON, so a damaged or replaced archive is refused instead of trained on. :func:`pack_bundle` writes both
files from a freshly built folder (``python -m claas_verl.tiny gym DIR --build --ship``).

Why ship weights instead of rebuilding: a build is deterministic on one machine (one thread, seeded), but nothing
guarantees the same bits on another CPU family, and a result on rebuilt weights is a new measurement. Shipping the
3 MB folder makes the benchmark's π0 and experts the same wherever it runs.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import sys
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from claas_verl.tiny.fingerprint import bundle_fingerprint

BUNDLES_DIR_ENV = "CLAAS_VERL_BUNDLES"


@dataclass(frozen=True)
class BundlePaths:
    """The files every unpacked bundle has: its manifest and its student (the gym and reader bundles extend it)."""

    root: Path

    @property
    def manifest(self) -> Path:
        return self.root / "manifest.json"

    @property
    def student(self) -> Path:
        return self.root / "student"


def bundle_dir(env_var: str, default: str | os.PathLike) -> Path:
    """A bundle's directory: ``$env_var`` when set and non-empty, else ``default``."""
    return Path(os.environ.get(env_var) or default)


def bundles_dir() -> Path:
    """``$CLAAS_VERL_BUNDLES`` if set, else the repository's ``benchmarks/bundles/`` (beside the package)."""
    env = os.environ.get(BUNDLES_DIR_ENV)
    return Path(env) if env else Path(__file__).resolve().parents[2] / "benchmarks" / "bundles"


def shipped_name(kind: str, version: str, seed: int) -> str:
    return f"{kind}_v{version}_seed{seed}"


def shipped(kind: str, version: str, seed: int) -> tuple[Path, dict] | None:
    """``(archive, record)`` of the shipped bundle of this kind, version and seed, or None when there is none."""
    name = shipped_name(kind, version, seed)
    archive, record = bundles_dir() / f"{name}.tar.gz", bundles_dir() / f"{name}.json"
    if not (archive.is_file() and record.is_file()):
        return None
    info = json.loads(record.read_text())
    if str(info.get("version")) != str(version) or int(info.get("seed", -1)) != seed or "fingerprint" not in info:
        raise ValueError(f"{record}: records version {info.get('version')!r}, seed {info.get('seed')!r} and "
                         f"fingerprint {info.get('fingerprint')!r}, expected version {version!r} and seed {seed}; "
                         f"re-pack it with `python -m claas_verl.tiny {kind} DIR --build --ship`")
    return archive, info


def _safe_members(tar: tarfile.TarFile, archive: Path):
    for member in tar.getmembers():
        name = Path(member.name)
        if not (member.isfile() or member.isdir()) or name.is_absolute() or ".." in name.parts:
            raise ValueError(f"{archive}: member {member.name!r} is not a plain file or folder inside the bundle; "
                             "the archive was not written by pack_bundle")
        yield member


def unpack_shipped(archive: Path, info: dict, target: Path) -> None:
    """Extract ``archive`` into the new folder ``target`` and check its fingerprint against ``info``."""
    target.mkdir(parents=True)
    with tarfile.open(archive, "r:gz") as tar:
        members = list(_safe_members(tar, archive))
        if hasattr(tarfile, "data_filter"):  # Python >= 3.10.12 / 3.11.4: refuse links and odd modes as well
            tar.extractall(target, members=members, filter="data")
        else:  # pragma: no cover - older interpreters: _safe_members already refused everything but files/folders
            tar.extractall(target, members=members)
    found = bundle_fingerprint(target)
    if found != info["fingerprint"]:
        raise ValueError(f"{archive}: the extracted bundle's fingerprint is {found}, its record says "
                         f"{info['fingerprint']}: the archive is damaged or was replaced. Restore it from git "
                         "(`git checkout -- benchmarks/bundles`) or rebuild with `--build`")


def pack_bundle(root: Path, kind: str, version: str, seed: int, built_with: str) -> tuple[Path, Path]:
    """Write ``<kind>_v<version>_seed<seed>.tar.gz`` of the bundle folder ``root`` (sorted members, fixed owners
    and times, so packing the same files gives the same archive) and its JSON record into :func:`bundles_dir`."""
    out = bundles_dir()
    out.mkdir(parents=True, exist_ok=True)
    name = shipped_name(kind, version, seed)
    archive = out / f"{name}.tar.gz"

    def plain(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mtime = 0
        return info

    with open(archive, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w") as tar:
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            tar.add(path, arcname=path.relative_to(root).as_posix(), filter=plain)
    record = out / f"{name}.json"
    record.write_text(json.dumps({"kind": kind, "version": str(version), "seed": seed,
                                  "fingerprint": bundle_fingerprint(root), "built_with": built_with},
                                 indent=1, sort_keys=True) + "\n")
    return archive, record


def put_in_place(out_dir: Path, ship: tuple[Path, dict] | None, build: Callable[[Path], None], log: str) -> None:
    """Make a bundle at ``out_dir``: unpacked from ``ship`` (:func:`shipped`), or by ``build(tmp)`` when ``ship`` is
    None, into a temporary sibling renamed into place, so a killed build never leaves a half bundle there."""
    tmp = out_dir.with_name(f".{out_dir.name}.build-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if ship is None:
            build(tmp)
        else:
            print(f"{log} unpacking the shipped bundle {ship[0].name} (fingerprint {ship[1]['fingerprint']}) "
                  f"into {out_dir}", file=sys.stderr, flush=True)
            unpack_shipped(*ship, tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
