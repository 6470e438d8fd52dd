"""scripts/gpu_bundle_check.py, the GPU bundle's checker, on hand-made wheels (no network), and the
lazy imports the bundle relies on (ray, deepspeed, wandb and vllm are not carried to the GPU machine)."""

from __future__ import annotations

import ast
import importlib.util
import io
import json
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_bundle_check", ROOT / "scripts/gpu_bundle_check.py")
gbc = importlib.util.module_from_spec(_spec)
sys.modules["gpu_bundle_check"] = gbc  # dataclasses look their module up
_spec.loader.exec_module(gbc)


def wheel(folder: Path, name: str, version: str, *requires: str) -> Path:
    path = folder / f"{name}-{version}-py3-none-any.whl"
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    lines += [f"Requires-Dist: {r}" for r in requires]
    with zipfile.ZipFile(path, "w") as whl:
        whl.writestr(f"{name}-{version}.dist-info/METADATA", "\n".join(lines) + "\n")
    return path


def static(tmp_path, capsys, image: str, *wheels: Path, shadow: Path | None = None) -> tuple[int, str]:
    (tmp_path / "image.txt").write_text(image)
    args = ["static", "--image", str(tmp_path / "image.txt"), *map(str, wheels)]
    rc = gbc.main(args + (["--shadow", str(shadow)] if shadow else []))
    return rc, capsys.readouterr().out


def test_met_by_a_carried_wheel_or_an_image_package(tmp_path, capsys):
    rc, out = static(
        tmp_path,
        capsys,
        "torch==2.11.0\nrich\n",
        wheel(tmp_path, "app", "1.0", "lib>=2", "torch>=2.11,<2.15", "rich"),
        wheel(tmp_path, "lib", "2.1"),
    )
    assert rc == 0 and "0 unmet, 0 unverified" in out


def test_unmet_too_old_missing_and_carried_twice(tmp_path, capsys):
    rc, out = static(
        tmp_path,
        capsys,
        "torch==2.10.0\nnumpy\n",
        wheel(tmp_path, "app", "1.0", "lib>=3", "torch>=2.11", "absent"),
        wheel(tmp_path, "lib", "2.1"),
        wheel(tmp_path, "numpy", "2.5"),
    )
    assert rc == 1
    assert "app 1.0 requires lib>=3: found 2.1" in out
    assert "app 1.0 requires torch>=2.11: the image has 2.10.0" in out
    assert "app 1.0 requires absent: neither carried nor in the image" in out
    assert "numpy is carried although the image has it" in out


def test_markers_are_those_of_cpython_312_on_linux(tmp_path, capsys):
    rc, out = static(
        tmp_path,
        capsys,
        "",
        wheel(
            tmp_path,
            "app",
            "1.0",
            'pywin32; sys_platform == "win32"',
            'tomli; python_version < "3.11"',
            'needed; python_version >= "3.12" and platform_machine == "x86_64"',
        ),
    )
    assert rc == 1 and "requires needed;" in out and "pywin32" not in out and "tomli" not in out


def test_extras_count_only_where_a_parent_asks_for_them(tmp_path, capsys):
    lib = wheel(tmp_path, "lib", "1.0", 'fast>=2; extra == "speed"', 'docs; extra == "docs"')
    rc, out = static(tmp_path, capsys, "", wheel(tmp_path, "app", "1.0", "lib[speed]"), lib)
    assert rc == 1 and "lib 1.0 requires fast>=2" in out and "docs" not in out
    rc, out = static(tmp_path, capsys, "", wheel(tmp_path, "app", "1.0", "lib"), lib)
    assert rc == 0


def test_an_unknown_image_version_is_unverified_unless_a_shadow_wheel_is_carried(tmp_path, capsys):
    carried = tmp_path / "carried"
    shadows = tmp_path / "shadow"
    carried.mkdir(), shadows.mkdir()
    wheel(carried, "app", "1.0", "certifi>=2026.10", "six", "ray>=2")  # ray: lazy, not carried
    rc, out = static(tmp_path, capsys, "certifi\nsix\n", carried)
    assert rc == 0 and "unverified  app 1.0 requires certifi>=2026.10" in out
    assert "not carried (ppoflow imports them lazily): ray" in out
    wheel(shadows, "certifi", "2026.10.19")
    rc, out = static(tmp_path, capsys, "certifi\nsix\n", carried, shadow=shadows)
    assert rc == 0 and "0 unverified" in out and "shadow wheels, installed where" in out and "certifi" in out


def test_shadow_wheels_chosen_where_the_image_version_misses():
    dist = gbc.dist_from_metadata
    wheels = {"app": dist("Name: app\nVersion: 1\nRequires-Dist: rich>=13\nRequires-Dist: certifi>=2026\n")}
    shadow = {
        "rich": dist("Name: rich\nVersion: 15\nRequires-Dist: pygments>=2.13\n", "rich.whl"),
        "certifi": dist("Name: certifi\nVersion: 2026.10\n", "certifi.whl"),
        "pygments": dist("Name: pygments\nVersion: 2.21\n", "pygments.whl"),
    }
    image = {"rich": Version("12.0"), "certifi": Version("2026.1"), "pygments": Version("2.10")}
    chosen = gbc.shadows_needed(wheels, shadow, image.get, gbc.TARGET_ENV)
    assert set(chosen) == {"rich", "pygments"}  # pygments: for the rich it carries
    assert "app requires rich>=13, the image has 12.0" in chosen["rich"]


def test_a_bundle_built_from_other_sources_is_stale(tmp_path, monkeypatch):
    (tmp_path / "pyproject.toml").write_text('[tool.setuptools.package-dir]\n"app" = "src"\n')
    (tmp_path / "src").mkdir()
    (tmp_path / "src/a.py").write_text("x = 1\n")
    monkeypatch.setattr(gbc, "ROOT", tmp_path)
    (tmp_path / gbc.MANIFEST).write_text(json.dumps({"source_files": gbc.source_files(tmp_path)}))
    assert gbc.stale(tmp_path) == ""
    (tmp_path / "src/a.py").write_text("x = 2\n")
    (tmp_path / "src/b.py").write_text("")
    assert "2 changed source file(s) (src/a.py, src/b.py)" in gbc.stale(tmp_path)


def archive(folder: Path, members: dict[str, bytes], links: dict[str, str] | None = None) -> Path:
    """A bundle folder whose deps.tar.xz holds `members` (name → bytes) and symbolic `links`."""
    folder.mkdir()
    with tarfile.open(folder / gbc.ARCHIVE, "w:xz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    return folder


@pytest.mark.parametrize(
    ("members", "links"),
    [
        ({"/tmp/planted-1.0-py3-none-any.whl": b""}, None),  # absolute: read back from outside the bundle
        ({"wheels/../../planted-1.0-py3-none-any.whl": b""}, None),
        ({"notes.txt": b"x"}, None),
        ({}, {"wheels/passwd-1.0-py3-none-any.whl": "/etc/passwd"}),
    ],
    ids=["absolute", "traversal", "not-a-wheel", "link"],
)
def test_an_archive_member_other_than_a_wheel_under_wheels_or_shadow_is_refused(tmp_path, members, links):
    folder = archive(tmp_path / "bundle", members, links)
    with pytest.raises(gbc.BundleError, match="not a wheel under wheels/ or shadow/"):
        gbc.read_bundle(folder, tmp_path / "extract")
    assert not (tmp_path / "extract").exists() or not any((tmp_path / "extract").rglob("*"))


def test_an_unreadable_bundle_fails_in_one_line_with_exit_2(tmp_path, capsys):
    """2 means nothing was installed (gpu_proof.sh stops); 1 would mean installed, requirements unmet."""
    assert gbc.main(["install", str(tmp_path / "site"), str(tmp_path)]) == 2  # no manifest, no archive
    assert capsys.readouterr().err.count("\n") == 1
    folder = archive(tmp_path / "bundle", {"wheels/a-1.0-py3-none-any.whl": b"not a zip"})
    data = (folder / gbc.ARCHIVE).read_bytes()
    (folder / gbc.ARCHIVE).write_bytes(data[: len(data) // 2])  # truncated
    assert gbc.main(["static", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpu_bundle_check: ") and err.count("\n") == 1
    assert gbc.main(["static", str(tmp_path / "no-such-folder")]) == 2
    assert "no-such-folder does not exist" in capsys.readouterr().err


def test_an_empty_folder_of_wheels_is_not_a_pass(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    rc, out = static(tmp_path, capsys, "six\n", tmp_path / "empty")
    assert rc == 1 and "EMPTY       no wheel to check" in out


def _module_level_imports(tree: ast.AST):
    """Import statements that run when the module is imported (not inside a function, nor under
    `if TYPE_CHECKING:`)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (n for child in node.orelse for n in _module_level_imports(child))
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        yield from _module_level_imports(node)


@pytest.mark.parametrize("folder", ["ppoflow", "engine", "tasks", "flows", "conf"])
def test_packages_the_bundle_leaves_out_are_imported_lazily(folder):
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for node in _module_level_imports(ast.parse(path.read_text(), filename=str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [
                f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n.split(".")[0] in gbc.LAZY
            ]
    assert not found, f"imported when the module is: {found}"
