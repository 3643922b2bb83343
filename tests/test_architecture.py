"""The one-way layers of docs/architecture.md: the import contracts hold, they would catch a model module
importing the demos, and `import moesaic` loads no family."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).parent / "lint-imports"


def lint(root: Path) -> subprocess.CompletedProcess:
    """lint-imports over the `moesaic` package found under `root`, with the contracts of pyproject.toml."""
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [str(LINT), "--config", str(root / "pyproject.toml"), "--no-cache"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_import_contracts_hold():
    r = lint(ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]


def test_contracts_catch_a_model_module_importing_the_demos(tmp_path):
    shutil.copytree(ROOT / "moesaic", tmp_path / "moesaic", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    model = tmp_path / "moesaic" / "models" / "mistral4.py"
    model.write_text(model.read_text() + "\n\nfrom ..demo import mistral4 as _fixtures  # noqa: E402,F401\n")
    r = lint(tmp_path)
    assert r.returncode != 0
    assert "moesaic.models.mistral4 -> moesaic.demo" in r.stdout


def test_import_moesaic_loads_no_family():
    code = "import moesaic, sys; print(sorted(m for m in sys.modules if m.startswith('moesaic.models.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"
