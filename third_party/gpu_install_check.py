"""Resolve the GPU install of claas_verl without a GPU and without installing anything (``make check-gpu-install``).

``make install-gpu`` installs, constrained by ``third_party/gpu_constraints.txt`` (the set verl 0.9.1 was released
against): torch, the project with its ``test``, ``eval`` and ``gpu`` extras, flash-attn's build requirements, and
flash-attn itself from its sdist without build isolation. Here pip resolves the same requests (``--dry-run
--report``, against the index pip is configured with):

1. flash-attn: whether a wheel exists for the node's platform (manylinux up to ``--glibc``, this CPython), and that
   its sdist's metadata builds without isolation against this interpreter's torch, as the install builds it;
2. the whole set on this machine's platform (Linux x86_64, this CPython: PyPI's torch for Linux is its CUDA build;
   the ``eval`` extra pulls pure-Python packages published as sdists only, so this cannot be a binary-only
   resolution for another platform), then every chosen wheel's platform tag is checked against ``--glibc``.

Checked: every pin chosen exactly, verl and Ray at setup.py's versions, vLLM at or above the oldest release verl
0.9.1's rollout accepts. The summary is printed and written to ``--out`` (``third_party/gpu_install_check.txt``).
Exit status 0 when the set resolves and every check holds, 1 otherwise.

Usage (with the CPU venv's interpreter, which has torch for step 1; CPython as on the GPU nodes)::

    python third_party/gpu_install_check.py [--glibc 2.35] [--out third_party/gpu_install_check.txt]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONSTRAINTS = REPO / "third_party" / "gpu_constraints.txt"
# verl 0.9.1's vLLM rollout refuses older vLLM releases at import
VLLM_MIN = (0, 18)
# built by `make install-gpu` from its sdist (--no-build-isolation: its build imports torch)
SOURCE_BUILT = "flash-attn"
# flash-attn's build imports these; make install-gpu installs them first (its sdist declares only torch and einops)
FLASH_ATTN_BUILD = ("packaging", "psutil", "ninja", "wheel", "setuptools", "einops")
# torchcodec: verl-core requires it unpinned, so pip takes its newest release, built against a newer torch than the
# pinned one; it then fails to load and breaks `import transformers`. `make install-gpu` removes it (text models
# need no video decoding), as `make install-vllm` does with the CPU build's companion wheels.
DROPPED = ("torchcodec",)


def read_pins(path: Path = CONSTRAINTS) -> dict[str, str]:
    """``{name: version}`` of the ``name==version`` lines of a constraints file (names normalised)."""
    pins = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9._-]+)==([A-Za-z0-9.+!-]+)", line)
        if m is None:
            raise ValueError(f"{path}: {line!r} is not an exact pin (name==version)")
        pins[normalize(m.group(1))] = m.group(2)
    return pins


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def setup_versions() -> dict[str, str]:
    text = (REPO / "setup.py").read_text()
    return {"verl": re.search(r'VERL_VERSION = "([^"]+)"', text).group(1),
            "ray": re.search(r'RAY_VERSION = "([^"]+)"', text).group(1)}


def platform_args(glibc: str) -> list[str]:
    """pip takes an explicit --platform literally (no older manylinux tags), so every accepted tag is listed."""
    major, minor = (int(x) for x in glibc.split("."))
    tags = [f"manylinux_{major}_{m}_x86_64" for m in range(minor, 4, -1)]
    tags += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]
    return [a for t in tags for a in ("--platform", t)]


def pip_report(args: list[str], workdir: Path, env: dict | None = None) -> tuple[dict | None, str]:
    report = workdir / f"report_{len(list(workdir.glob('report_*')))}.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
           "--disable-pip-version-check", "--target", str(workdir / "target"), "--report", str(report), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    errors = "\n".join(x for x in (proc.stdout + proc.stderr).splitlines()
                       if "ERROR" in x or "conflict" in x.lower())
    if proc.returncode != 0 or not report.exists():
        return None, errors or proc.stderr[-4000:]
    return json.loads(report.read_text()), errors


def chosen(report: dict) -> dict[str, dict]:
    return {normalize(i["metadata"]["name"]): i for i in report["install"]}


def project_requirements(workdir: Path) -> list[str]:
    """The project's ``Requires-Dist`` lines (extras included), from pip's own metadata build of setup.py."""
    report, err = pip_report(["--no-deps", str(REPO)], workdir)
    if report is None:
        raise RuntimeError(f"pip could not read the project's metadata:\n{err}")
    return report["install"][0]["metadata"].get("requires_dist", [])


def extra_requirements(requires: list[str], extra: str) -> list[str]:
    return [r.split(";", 1)[0].strip() for r in requires if re.search(rf"extra\s*==\s*[\"']{extra}[\"']", r)]


def req_name(req: str) -> str:
    return normalize(re.match(r"[A-Za-z0-9._-]+", req).group(0))


def wheel_glibc(url: str) -> tuple[int, int] | None:
    """The newest glibc a chosen wheel's platform tags ask for (None: pure Python or an sdist)."""
    name = url.rsplit("/", 1)[-1]
    if not name.endswith(".whl"):
        return None
    platforms = name[:-4].split("-")[-1].split(".")
    need = []
    for tag in platforms:
        m = re.fullmatch(r"manylinux_(\d+)_(\d+)_\w+", tag)
        legacy = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}
        if m:
            need.append((int(m.group(1)), int(m.group(2))))
        elif tag.split("_")[0] in legacy:
            need.append(legacy[tag.split("_")[0]])
    return min(need) if need else None  # any one tag that the node accepts is enough


def check(glibc: str) -> tuple[bool, list[str]]:
    pins = read_pins()
    lines, ok = [], True
    node_glibc = tuple(int(x) for x in glibc.split("."))
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        gpu = extra_requirements(project_requirements(work), "gpu")
        missing = sorted(set(pins) - {SOURCE_BUILT} - {req_name(r) for r in gpu})
        if missing:
            ok = False
            lines.append(f"FAIL setup.py's gpu extra lacks the pins {missing} of {CONSTRAINTS.name}")

        # flash-attn: no wheel for the node's platform; its sdist's metadata builds without isolation
        fa = pins[SOURCE_BUILT]
        target = ["--python-version", py, "--implementation", "cp", "--only-binary=:all:", *platform_args(glibc)]
        wheel, _ = pip_report([*target, "--no-deps", f"{SOURCE_BUILT}=={fa}"], work)
        lines.append(f"{SOURCE_BUILT}=={fa}: " + ("a wheel exists for the node's platform" if wheel else
                                                 "no wheel for the node's platform: make install-gpu builds its sdist"))
        env = dict(os.environ, FLASH_ATTENTION_SKIP_CUDA_BUILD="TRUE")  # metadata only: no nvcc on this machine
        sdist, err = pip_report(["--no-deps", "--no-build-isolation", "--no-binary", SOURCE_BUILT,
                                 f"{SOURCE_BUILT}=={fa}"], work, env=env)
        if sdist is None:
            ok = False
            lines.append(f"   FAIL its sdist does not build metadata without isolation:\n{err}")
            fa_requires = []
        else:
            fa_requires = [r.split(";", 1)[0].strip() for r in sdist["install"][0]["metadata"].get("requires_dist", [])]
            lines.append(f"   ok   its sdist's metadata builds with --no-build-isolation; requires {fa_requires}")

        # the whole install, as make install-gpu asks for it, resolved by pip
        report, err = pip_report(["-c", str(CONSTRAINTS), f"{REPO}[test,eval,gpu]",
                                  *dict.fromkeys([*FLASH_ATTN_BUILD, *fa_requires])], work)
        if report is None:
            return False, [*lines, "FAIL project[test,eval,gpu] + flash-attn's build requirements do not resolve:", err]
        got = chosen(report)
        lines.append(f"project[test,eval,gpu] + flash-attn's build requirements: {len(got)} distributions "
                     f"(CPython {py}, Linux x86_64)")
        want = {**pins, **setup_versions()}
        for name, version in sorted(want.items()):
            if name == SOURCE_BUILT:
                continue
            have = got.get(name, {}).get("metadata", {}).get("version")
            good = have is not None and have.split("+")[0] == version
            ok &= good
            lines.append(f"   {'ok  ' if good else 'FAIL'} {name}=={have} (pinned {version})")
        vllm = tuple(int(x) for x in got["vllm"]["metadata"]["version"].split(".")[:2]) if "vllm" in got else (0, 0)
        good = vllm >= VLLM_MIN
        ok &= good
        lines.append(f"   {'ok  ' if good else 'FAIL'} vllm >= {'.'.join(map(str, VLLM_MIN))} (verl 0.9.1's rollout)")
        newer = sorted(f"{n} (glibc {'.'.join(map(str, g))})" for n, i in got.items()
                       if (g := wheel_glibc(i["download_info"]["url"])) is not None and g > node_glibc)
        ok &= not newer
        lines.append(f"   {'ok  ' if not newer else 'FAIL'} every chosen wheel installs on glibc {glibc}"
                     + (f": not {newer}" if newer else ""))
        sdists = sorted(n for n, i in got.items() if not i["download_info"]["url"].endswith(".whl")
                        and n != "claas-verl")
        lines.append(f"   note built from sdists by pip on install: {sdists}")
        for name in DROPPED:
            if name in got:
                lines.append(f"   note {name}=={got[name]['metadata']['version']} comes with verl-core; "
                             "make install-gpu removes it (built against another torch)")
    return ok, lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--glibc", default="2.35", help="the GPU node's glibc (Ubuntu 22.04: 2.35)")
    parser.add_argument("--out", default=str(REPO / "third_party" / "gpu_install_check.txt"))
    args = parser.parse_args(argv)
    ok, lines = check(args.glibc)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = "\n".join([f"# make check-gpu-install, {stamp}: {'RESOLVES' if ok else 'FAILS'}", *lines]) + "\n"
    print(text, end="")
    Path(args.out).write_text(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
