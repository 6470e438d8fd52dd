"""Checks, and installs on the GPU machine, the bundle scripts/gpu-bundle builds: the wheels the GPU
machine's image (scripts/gpu-image-packages.txt) lacks for ppoflow to run there offline.
Standard library and `packaging` only; Python 3.11 and 3.12. BUNDLE defaults to .gpu-bundle/.

  gpu_bundle_check.py static [BUNDLE | WHEEL_OR_DIR... [--shadow DIR]] [--image LIST]
      here: every requirement (markers for CPython 3.12 on x86-64 Linux; extras where a parent asks
      for them) of every carried wheel is met by a carried wheel or an image package (version-checked
      where the list gives one), and ppoflow's wheel is as new as its sources; exit 1 if not
  gpu_bundle_check.py install SITE [BUNDLE]            there: all of it, then `export PYTHONPATH=SITE`
      refuses a stale bundle, unpacks it, installs its wheels into SITE (pip --no-index --no-deps
      --target), with the shadow wheels the image's versions need, then runs `site SITE`; exit 2
      when nothing was installed (stale, unreadable, pip failed), 1 when installed with unmet
      requirements. Every command exits 2, in one line, on a bundle or wheel it cannot read.
  gpu_bundle_check.py shadow [BUNDLE]                  there: the shadow wheels the image needs
  PYTHONPATH=SITE gpu_bundle_check.py site SITE        there: every requirement of every distribution
      in SITE (and each other distribution's requirements on a name in SITE) is met by what
      importlib.metadata sees; one line per unmet requirement, exit 1 if any
The build (scripts/gpu-bundle) also uses: needs, plan, pack, manifest.

A shadow wheel is a small wheel of a package the image has, at constraints.txt's version, installed
only where the image's version misses a carried wheel's requirement (the list gives few versions).
LAZY: ppoflow's requirements it imports only inside the functions that use them, never on the path
the bundle serves (`ppoflow train`, `ppoflow query`, pytest with tests/conftest.py: measured by
recording sys.modules); they are not carried, and requirements on them are reported, not failed.
"""

from __future__ import annotations

import argparse
import email
import hashlib
import importlib.metadata
import io
import json
import lzma
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parents[1]
IMAGE_LIST = Path(__file__).resolve().with_name("gpu-image-packages.txt")
BUNDLE = ROOT / ".gpu-bundle"
ARCHIVE = "deps.tar.xz"  # wheels/*.whl (always installed), shadow/*.whl: zips stored uncompressed, xz
MANIFEST = "manifest.json"
LAZY = frozenset({"ray", "deepspeed", "wandb", "vllm"})
# The image's interpreter, CPython 3.12.3 on x86-64 Linux, for evaluating markers here.
TARGET_ENV = {
    "implementation_name": "cpython",
    "implementation_version": "3.12.3",
    "os_name": "posix",
    "platform_machine": "x86_64",
    "platform_python_implementation": "CPython",
    "platform_release": "",
    "platform_system": "Linux",
    "platform_version": "",
    "python_full_version": "3.12.3",
    "python_version": "3.12",
    "sys_platform": "linux",
}
UNKNOWN = "unknown"  # the version of an image package the list names without one
MEMBER = re.compile(r"(wheels|shadow)/[^/]+\.whl")  # the only names a bundle's archive may hold


class BundleError(Exception):
    """A bundle, wheel or folder that cannot be read as one: said in one line, exit 2."""


@dataclass
class Dist:
    """A distribution's name, version and requirements (from a wheel or an installed METADATA)."""

    name: str
    version: Version
    requires: list[Requirement]
    origin: str = ""  # the wheel's path, or the folder it is installed in


def norm(name: str) -> str:
    return canonicalize_name(name)


def dist_from_metadata(text: str, origin: str = "") -> Dist:
    msg = email.message_from_string(text)
    reqs = [Requirement(r) for r in msg.get_all("Requires-Dist") or []]
    return Dist(norm(msg["Name"]), Version(msg["Version"]), reqs, origin)


def dist_from_wheel(path: str | Path, fileobj=None) -> Dist:
    try:
        parse_wheel_filename(Path(path).name)
    except InvalidWheelFilename as error:
        raise BundleError(f"{path}: {error}") from None
    with zipfile.ZipFile(fileobj or path) as whl:
        metadata = [m for m in whl.namelist() if m.endswith(".dist-info/METADATA") and m.count("/") == 1]
        if len(metadata) != 1:
            raise BundleError(f"{path}: {len(metadata)} .dist-info/METADATA files, not one")
        return dist_from_metadata(whl.read(metadata[0]).decode(), str(path))


def add(dists: dict[str, Dist], dist: Dist) -> None:
    if dist.name in dists:  # pip installs neither of two versions
        raise BundleError(f"two wheels of {dist.name}: {dists[dist.name].origin}, {dist.origin}")
    dists[dist.name] = dist


def read_wheels(paths: list[str | Path]) -> dict[str, Dist]:
    """The wheels named, and those in the folders named, by name."""
    dists: dict[str, Dist] = {}
    for p in map(Path, paths):
        if not p.exists():
            raise BundleError(f"{p} does not exist")
        for whl in sorted(p.glob("*.whl")) if p.is_dir() else [p]:
            add(dists, dist_from_wheel(whl))
    return dists


def read_bundle(folder: Path, extract_to: Path | None = None) -> tuple[dict[str, Dist], dict[str, Dist]]:
    """(wheels, shadow wheels) of a bundle: its archive's (read in memory, or extracted to extract_to),
    and ppoflow's wheel beside it (always carried)."""
    archive = folder / ARCHIVE
    if not archive.is_file():
        raise BundleError(f"no {archive}: build the bundle with scripts/gpu-bundle")
    wheels: dict[str, Dist] = {}
    shadow: dict[str, Dist] = {}
    with tarfile.open(archive, "r:xz") as tar:
        for member in tar:
            if not (member.isfile() and MEMBER.fullmatch(member.name)):
                raise BundleError(f"{archive} holds '{member.name}', not a wheel under wheels/ or shadow/")
            if extract_to is None:
                dist = dist_from_wheel(member.name, io.BytesIO(tar.extractfile(member).read()))
            else:
                tar.extract(member, extract_to, filter="data")
                dist = dist_from_wheel(extract_to / member.name)
            add(shadow if member.name.startswith("shadow/") else wheels, dist)
    for whl in sorted(folder.glob("*.whl")):
        add(wheels, dist_from_wheel(whl))
    return wheels, shadow


def read_image_list(path: Path) -> dict[str, Version | str]:
    """NAME or NAME==VERSION per line ('#' starts a comment): name -> Version, or UNKNOWN."""
    image: dict[str, Version | str] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            image[norm(name)] = Version(version) if version else UNKNOWN
    return image


def read_pins(path: Path) -> dict[str, str]:
    """constraints.txt's NAME==VERSION lines: name -> version."""
    pins = {}
    for line in path.read_text().splitlines():
        name, sep, version = line.split("#", 1)[0].partition("==")
        if sep:
            pins[norm(name.strip())] = version.strip()
    return pins


def active(dist: Dist, extras: set[str] | frozenset[str], env: dict) -> list[Requirement]:
    """The requirements that apply, with these extras asked for, in this environment."""
    return [
        req
        for req in dist.requires
        if req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in {"", *extras})
    ]


def satisfies(req: Requirement, version: Version | str) -> bool:
    """Whether a version meets the requirement (an UNKNOWN one is not held against it)."""
    return version == UNKNOWN or req.specifier.contains(version, prereleases=True)


@dataclass
class Report:
    """(name, line) findings. unmet: fails the check; fallback: met by a carried shadow wheel where
    the image's version is unknown or too old; unverified: the image's version is unknown, and no
    shadow wheel is carried (the `site` check on the machine decides)."""

    unmet: list[tuple[str, str]] = field(default_factory=list)
    fallback: list[tuple[str, str]] = field(default_factory=list)
    unverified: list[tuple[str, str]] = field(default_factory=list)
    lazy: set[str] = field(default_factory=set)


def check(roots, dists, image, env, shadow=None) -> Report:
    """Walks every requirement of the root distributions, and those of the extras they ask of others.

    dists: name -> Dist counted as installed (the carried wheels here; what importlib sees there).
    image: name -> Version or UNKNOWN, for names not in dists (empty on the machine).
    shadow: name -> Dist of a carried shadow wheel of an image package."""
    report, todo, done = Report(), [(d, frozenset()) for d in roots], set()
    while todo:
        dist, extras = todo.pop()
        if (dist.name, extras) in done:
            continue
        done.add((dist.name, extras))
        for req in active(dist, extras, env):
            if norm(req.name) in LAZY:
                report.lazy.add(norm(req.name))
                continue
            found = judge(report, dist, req, dists, image, shadow or {})
            if found is not None and req.extras:
                todo.append((found, frozenset(req.extras)))
    return report


def judge(report: Report, dist: Dist, req: Requirement, dists, image, shadow) -> Dist | None:
    """Files one requirement (met: nowhere); returns the Dist meeting it where its metadata is known."""
    name, where = norm(req.name), f"{dist.name} {dist.version} requires {req}"
    if name in dists:
        found = dists[name]
        if not satisfies(req, found.version):
            report.unmet.append((name, f"{where}: found {found.version} ({found.origin})"))
        return found
    if name not in image:
        report.unmet.append((name, f"{where}: {'neither carried nor in the image' if image else 'missing'}"))
        return None
    have, carried = image[name], shadow.get(name)
    if not req.specifier or (have != UNKNOWN and satisfies(req, have)):
        return carried
    if carried is not None and satisfies(req, carried.version):
        report.fallback.append((name, f"{where} (the image: {have}; carried: {carried.version})"))
    elif have == UNKNOWN and req.specifier:
        report.unverified.append((name, f"{where}: the image's version is unknown"))
    elif have != UNKNOWN:
        report.unmet.append((name, f"{where}: the image has {have}"))
    return carried


def print_report(report: Report, verbose: bool = False) -> int:
    for _, line in report.unmet:
        print(f"UNMET       {line}")
    for _, line in report.unverified:
        print(f"unverified  {line}")
    shadowed: dict[str, list[str]] = {}
    for name, line in report.fallback:
        shadowed.setdefault(name, []).append(line)
    for line in (line for n in sorted(shadowed) if verbose for line in shadowed[n]):
        print(f"shadow      {line}")
    print(f"{len(report.unmet)} unmet, {len(report.unverified)} unverified (the image's version unknown)")
    if shadowed:
        print(f"shadow wheels, installed where the image's version misses: {' '.join(sorted(shadowed))}")
    if report.lazy:
        print(f"not carried (ppoflow imports them lazily): {' '.join(sorted(report.lazy))}")
    return 1 if report.unmet else 0


def source_files(root: Path) -> dict[str, str]:
    """sha256 of each file the bundle is built from: pyproject.toml, constraints.txt (the carried
    versions) and the .py and .yaml files of the folders ppoflow's package-dir maps (tracked or not:
    both travel with the repository)."""
    pyproject = root / "pyproject.toml"
    folders = set(tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-dir"].values())
    files = [p for p in (pyproject, root / "constraints.txt") if p.is_file()]
    for folder in sorted(folders):
        files += [p for p in (root / folder).rglob("*") if p.suffix in {".py", ".yaml"} and p.is_file()]
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(files)
        if "__pycache__" not in p.parts
    }


def stale(folder: Path) -> str:
    """'' if ppoflow's wheel in the bundle was built from the sources here, else why not."""
    try:
        built = json.loads((folder / MANIFEST).read_text())["source_files"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise BundleError(f"{folder / MANIFEST} is not a bundle's manifest ({error})") from None
    now = source_files(ROOT)
    changed = sorted(k for k in built.keys() | now.keys() if built.get(k) != now.get(k))
    if not changed:
        return ""
    more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
    return (
        f"ppoflow's wheel predates {len(changed)} changed source file(s) "
        f"({', '.join(changed[:3])}{more}): rebuild with scripts/gpu-bundle"
    )


def versions_outside(site: Path | None):
    """name -> Version of the distributions importlib finds on sys.path without SITE (the image's)."""
    paths = [p for p in sys.path if site is None or Path(p or ".").resolve() != site]
    found: dict[str, Version] = {}
    for d in importlib.metadata.distributions(path=paths):
        try:
            found.setdefault(norm(d.metadata["Name"]), Version(d.version))
        except (InvalidVersion, TypeError):
            continue
    return found.get


def shadows_needed(wheels: dict[str, Dist], shadow: dict[str, Dist], version_of, env) -> dict[str, str]:
    """name -> why, for each shadow wheel to install: its package is missing (version_of gives None)
    or at a version that misses a requirement of a wheel installed (a chosen shadow wheel included)."""
    chosen: dict[str, str] = {}
    while True:
        new = {}
        for dist in [*wheels.values(), *(shadow[n] for n in chosen)]:
            for req in active(dist, set(), env):
                name = norm(req.name)
                if name in shadow and name not in chosen and name not in new:
                    have = version_of(name)
                    if have is None or not req.specifier.contains(have, prereleases=True):
                        new[name] = f"{dist.name} requires {req}, the image has {have or 'none'}"
        if not new:
            return chosen
        chosen.update(new)


def installed(paths: list[str] | None = None) -> dict[str, Dist]:
    """Distributions importlib.metadata sees (the first of each name, as imports find them)."""
    dists: dict[str, Dist] = {}
    for d in importlib.metadata.distributions(**({"path": paths} if paths else {})):
        text, name = d.read_text("METADATA"), d.metadata["Name"]
        if text and name and norm(name) not in dists:
            dist = dist_from_metadata(text, str(d.locate_file("")))
            dists[dist.name] = dist
    return dists


# ---- commands ----------------------------------------------------------------------------------------


def cmd_static(args) -> int:
    image = read_image_list(args.image)
    paths = args.wheels or [BUNDLE]
    reason = ""
    if len(paths) == 1 and (Path(paths[0]) / ARCHIVE).exists():
        wheels, shadow = read_bundle(Path(paths[0]))
        reason = stale(Path(paths[0]))
    else:
        wheels, shadow = read_wheels(paths), read_wheels([args.shadow]) if args.shadow else {}
    clash = sorted(set(wheels) & set(image))
    report = check([*wheels.values(), *shadow.values()], wheels, image, TARGET_ENV, shadow)
    report.unmet += [(n, f"{n} is carried although the image has it (pip would keep two)") for n in clash]
    rc = print_report(report, args.verbose)
    if reason:
        print(f"STALE       {reason}")
    if not wheels:
        print("EMPTY       no wheel to check: build the bundle with scripts/gpu-bundle")
        return 1
    return 1 if rc or reason else 0


def cmd_shadow(args) -> int:
    site = Path(args.site).resolve() if args.site else None
    wheels, shadow = read_bundle(Path(args.bundle))
    for name, why in shadows_needed(wheels, shadow, versions_outside(site), default_environment()).items():
        print(f"{shadow[name].origin}\t{why}")
    return 0


def cmd_install(args) -> int:
    site, folder = Path(args.site).resolve(), Path(args.bundle)
    reason = stale(folder)
    if reason:
        print(f"gpu-bundle: {reason}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="gpu-bundle-") as tmp:
        wheels, shadow = read_bundle(folder, Path(tmp))
        chosen = shadows_needed(wheels, shadow, versions_outside(site), default_environment())
        for name, why in chosen.items():
            print(f"gpu-bundle: shadow {name} {shadow[name].version}: {why}")
        files = [d.origin for d in wheels.values()] + [shadow[n].origin for n in chosen]
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        if subprocess.run([*pip, "--upgrade", "--target", str(site), *files]).returncode:
            print(f"gpu-bundle: pip could not install the bundle into {site}", file=sys.stderr)
            return 2
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    rc = subprocess.run([sys.executable, __file__, "site", str(site)], env={**os.environ, "PYTHONPATH": path})
    if rc.returncode == 0:
        print(f"gpu-bundle: {len(files)} wheels in {site}; use them with: export PYTHONPATH={site}")
    return rc.returncode


def cmd_site(args) -> int:
    site = Path(args.site).resolve()
    if site not in {Path(p or ".").resolve() for p in sys.path}:
        sys.exit(f"gpu_bundle_check: {site} is not on sys.path: run with PYTHONPATH={site}")
    everything, ours = installed(), installed([str(site)])
    if not ours:
        sys.exit(f"gpu_bundle_check: no distribution in {site}")
    # Others whose requirements name a package installed here (a shadow wheel replaces the image's
    # version of a package other image packages may require too): those requirements are checked.
    others = []
    for dist in everything.values():
        reqs = [r for r in dist.requires if norm(r.name) in ours]
        if dist.name not in ours and reqs:
            others.append(Dist(dist.name, dist.version, reqs, dist.origin))
    return print_report(check([*ours.values(), *others], everything, {}, default_environment()))


def cmd_needs(args) -> int:
    """ppoflow's requirements the image lacks (LAZY aside), at constraints.txt's versions."""
    image, pins = read_image_list(args.image), read_pins(args.pins)
    for req in active(dist_from_wheel(args.ppoflow), set(), TARGET_ENV):
        name = norm(req.name)
        if name not in image and name not in LAZY:
            if name not in pins:
                sys.exit(f"gpu_bundle_check: {req.name} has no NAME==VERSION line in {args.pins}")
            print(f"{req.name}=={pins[name]}")
    return 0


def cmd_plan(args) -> int:
    """'bundle PATH' for each resolved wheel the image lacks; 'shadow NAME==VERSION' for each image
    package a carried wheel, or a shadow wheel, requires at versions the list cannot vouch for."""
    image, pins = read_image_list(args.image), read_pins(args.pins)
    resolved = read_wheels([args.resolved])
    ppoflow = dist_from_wheel(args.ppoflow)
    carried = {n: d for n, d in resolved.items() if n not in image}
    in_image = {n: d for n, d in resolved.items() if n in image}  # their metadata, at the pinned versions
    dists, roots, shadows = {**carried, ppoflow.name: ppoflow}, [ppoflow, *carried.values()], set()
    while roots:  # the shadow wheels' own requirements may need more of them
        report = check(roots, dists, image, TARGET_ENV, in_image)
        for name, line in report.unmet:
            if name not in image:  # pip resolved for this very target: a bug here, or a stale pool
                print(f"gpu_bundle_check: {line}", file=sys.stderr)
        new = {n for n, _ in report.fallback + report.unverified + report.unmet if n in image} - shadows
        shadows |= new
        roots = [in_image[n] for n in new if n in in_image]
    for dist in carried.values():
        print(f"bundle {dist.origin}")
    for name in sorted(shadows):
        version = pins.get(name) or (str(resolved[name].version) if name in resolved else None)
        if version:
            print(f"shadow {name}=={version}")
        else:
            print(f"gpu_bundle_check: no version of {name} to carry as a shadow (unpinned)", file=sys.stderr)
    return 0


def stored_copy(path: Path) -> bytes:
    """The wheel rezipped without compression (the same files, so the same RECORD), for xz."""
    out = io.BytesIO()
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info)
            info.compress_type = zipfile.ZIP_STORED
            dst.writestr(info, data)
    return out.getvalue()


def cmd_pack(args) -> int:
    """An uncompressed tar on stdout of STAGE's wheels/ and shadow/ wheels, each stored uncompressed."""
    stage = Path(args.stage)
    with tarfile.open(fileobj=sys.stdout.buffer, mode="w|") as tar:
        for whl in sorted(stage.glob("*/*.whl")):
            data = stored_copy(whl)
            info = tarfile.TarInfo(whl.relative_to(stage).as_posix())
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return 0


def cmd_manifest(args) -> int:
    def entry(dist: Dist) -> dict:
        size = Path(dist.origin).stat().st_size
        return {
            "name": dist.name,
            "version": str(dist.version),
            "file": Path(dist.origin).name,
            "bytes": size,
        }

    files = source_files(ROOT)
    manifest = {
        "target": "CPython 3.12, manylinux x86-64; the image of scripts/gpu-image-packages.txt",
        "not_carried_lazy": sorted(LAZY),
        "wheels": [entry(d) for d in read_wheels(args.wheels).values()],
        "shadow": [entry(d) for d in read_wheels([args.shadow]).values()],
        "source_digest": hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest(),
        "source_files": files,
    }
    print(json.dumps(manifest, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("static", help="here: the bundle (or wheels) against the image's list")
    p.add_argument("wheels", nargs="*", help="a bundle folder (default .gpu-bundle), or wheels/folders")
    p.add_argument("--shadow", help="a folder of shadow wheels (with wheels named)")
    p.add_argument("--image", type=Path, default=IMAGE_LIST)
    p.add_argument("-v", "--verbose", action="store_true", help="why each shadow wheel is carried")
    p = sub.add_parser("install", help="there: install the bundle into SITE and check it")
    p.add_argument("site")
    p.add_argument("bundle", nargs="?", default=BUNDLE)
    p = sub.add_parser("shadow", help="there: the shadow wheels the image's versions need")
    p.add_argument("bundle", nargs="?", default=BUNDLE)
    p.add_argument("--site", help="a folder to leave out of what counts as the image (the target)")
    p = sub.add_parser("site", help="there: every requirement in SITE met (PYTHONPATH=SITE)")
    p.add_argument("site")
    for name in ("needs", "plan"):
        p = sub.add_parser(name, help="the build's (scripts/gpu-bundle)")
        p.add_argument("--image", type=Path, default=IMAGE_LIST)
        p.add_argument("--pins", type=Path, default=ROOT / "constraints.txt")
        p.add_argument("ppoflow", help="ppoflow's wheel")
        if name == "plan":
            p.add_argument("resolved", help="the folder pip downloaded the closure into")
    p = sub.add_parser("pack", help="the build's: STAGE's wheels as a tar on stdout")
    p.add_argument("stage")
    p = sub.add_parser("manifest", help="the build's: manifest.json on stdout")
    p.add_argument("--shadow", required=True)
    p.add_argument("wheels", nargs="+")
    args = ap.parse_args(argv)
    try:
        return globals()[f"cmd_{args.cmd}"](args)
    except (BundleError, tarfile.TarError, EOFError, lzma.LZMAError, zipfile.BadZipFile, OSError) as error:
        print(f"gpu_bundle_check: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
