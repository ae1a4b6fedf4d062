"""The checkpoint package's maps: each room's docstring names every module in it, and the
package's own docstring names every room and every module beside them, so a reader finds where a
snapshot is written, persisted and restored from the package's first page."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CKPT = Path(__file__).resolve().parents[2] / "elasticft" / "ckpt"
ROOMS = sorted(p.parent.name for p in CKPT.glob("*/__init__.py"))


def docstring(package: Path) -> str:
    return ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""


def modules(package: Path) -> list[str]:
    return sorted(p.stem for p in package.glob("*.py") if p.name != "__init__.py")


def test_the_rooms_are_there() -> None:
    assert ROOMS == ["backup", "integrity", "memory", "persisting", "restoring"]


@pytest.mark.parametrize("room", ROOMS)
def test_a_rooms_docstring_maps_every_module_in_it(room: str) -> None:
    text = docstring(CKPT / room)
    missing = [m for m in modules(CKPT / room) if f"elasticft.ckpt.{room}.{m}" not in text]
    assert not missing, f"elasticft/ckpt/{room}/__init__.py does not name {missing}"


def test_the_packages_docstring_names_every_room_and_every_module_beside_them() -> None:
    text = docstring(CKPT)
    missing = [f"room {r}" for r in ROOMS if f"elasticft.ckpt.{r}`" not in text]
    missing += [m for m in modules(CKPT) if f"``{m}``" not in text]
    assert not missing, f"elasticft/ckpt/__init__.py does not name {missing}"
