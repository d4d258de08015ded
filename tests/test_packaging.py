"""What an installed sa_taskqueue tells tools about itself: version, types, licence and extras."""

from __future__ import annotations

import importlib.metadata
import importlib.resources

import sa_taskqueue as tq


def test_the_package_declares_its_annotations_for_type_checkers() -> None:
    assert importlib.resources.files("sa_taskqueue").joinpath("py.typed").is_file()


def test_the_installed_version_is_the_one_the_package_reports() -> None:
    assert importlib.metadata.version("sa_taskqueue") == tq.__version__


def test_the_licence_is_mit_and_ships_with_the_package() -> None:
    metadata = importlib.metadata.metadata("sa_taskqueue")
    assert metadata["License-Expression"] == "MIT"
    assert "LICENSE" in (metadata.get_all("License-File") or [])


def test_the_extras_the_readme_names_exist() -> None:
    extras = set(importlib.metadata.metadata("sa_taskqueue").get_all("Provides-Extra") or [])
    assert {"postgresql", "mysql", "oracle", "async", "flask", "fastapi"} <= extras
