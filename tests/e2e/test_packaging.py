"""A built wheel carries what the installed tracker needs: migrations, model registries."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_ships_migrations_and_models(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    wheel = next(tmp_path.glob("context_tracker-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    migrations = sorted(p.name for p in (ROOT / "alembic" / "versions").glob("*.py"))
    assert migrations, "no migrations in the checkout?"
    for name in migrations:
        assert f"tracker/alembic/versions/{name}" in names
    for name in (
        "tracker/alembic/env.py",
        "tracker/alembic/script.py.mako",
        "tracker/counting/models.json",
        "tracker/demo/models.json",
        "workers/tasks.py",
    ):
        assert name in names, name
    # every module of the product ships: a subpackage missing from [tool.setuptools] packages would not
    sources = sorted(
        p.relative_to(ROOT).as_posix()
        for base in ("tracker", "workers")
        for p in (ROOT / base).rglob("*.py")
        if "__pycache__" not in p.parts
    )
    missing = [name for name in sources if name not in names]
    assert not missing, f"not in the wheel (add the package to [tool.setuptools] packages): {missing}"
