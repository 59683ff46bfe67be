"""Real installed plugin distributions for tests, made without pip: package sources beside a
``<name>-<version>.dist-info`` folder, in a directory that only the tests' subprocesses see (through
PYTHONPATH), where importlib.metadata finds them exactly as it finds pip-installed ones."""

from __future__ import annotations

import os
import pathlib
import re
from dataclasses import dataclass, field
from typing import Mapping

from kernelmux.registry import ENTRY_POINT_GROUP

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10; pytest depends on tomli there
    import tomli as tomllib

__all__ = ["Distribution", "from_project", "install", "pythonpath_env"]


@dataclass(frozen=True)
class Distribution:
    """What a wheel of a kernelmux plugin would install.

    - ``entry_points``: entry-point name -> object reference in the ``kernelmux.backends`` group.
    - ``files``: path relative to the install folder (``my_plugin/__init__.py``) -> source text.
    """

    name: str
    version: str
    entry_points: Mapping[str, str]
    files: Mapping[str, str] = field(default_factory=dict)


def from_project(project: pathlib.Path) -> Distribution:
    """The distribution that ``pip install <project>`` would install, read from its pyproject.toml
    (name, version, the kernelmux.backends entry points, and the sources of
    ``[tool.setuptools] packages``)."""
    config = tomllib.loads((project / "pyproject.toml").read_text())
    meta = config["project"]
    files = {}
    for package in config["tool"]["setuptools"]["packages"]:
        root = project / package.replace(".", "/")
        for source in sorted(root.glob("*.py")):  # the subpackages are listed on their own
            files[source.relative_to(project).as_posix()] = source.read_text()
    return Distribution(meta["name"], meta["version"], meta["entry-points"][ENTRY_POINT_GROUP], files)


def install(site: pathlib.Path, distribution: Distribution) -> pathlib.Path:
    """Write ``distribution`` into ``site`` (sources and dist-info, as pip would); return ``site``."""
    # The wheel spec's escaping of the name in the dist-info folder's name.
    stem = f"{re.sub(r'[-_.]+', '_', distribution.name)}-{distribution.version}"
    info = pathlib.Path(f"{stem}.dist-info")
    entry_points = "".join(f"{name} = {ref}\n" for name, ref in distribution.entry_points.items())
    written = dict(distribution.files)
    written[(info / "METADATA").as_posix()] = (
        f"Metadata-Version: 2.1\nName: {distribution.name}\nVersion: {distribution.version}\n"
    )
    written[(info / "entry_points.txt").as_posix()] = f"[{ENTRY_POINT_GROUP}]\n{entry_points}"
    written[(info / "INSTALLER").as_posix()] = "kernelmux-tests\n"
    for relative, text in written.items():
        path = site / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    record = [f"{relative},," for relative in written] + [f"{(info / 'RECORD').as_posix()},,"]
    (site / info / "RECORD").write_text("\n".join(record) + "\n")
    return site


def pythonpath_env(site: pathlib.Path, env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with ``site`` first on PYTHONPATH, so a subprocess imports and discovers what was
    installed there (ahead of site-packages) and this process does not."""
    existing = env.get("PYTHONPATH")
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), existing]))}
