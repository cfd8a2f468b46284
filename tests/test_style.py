import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_clean():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed")
    out = subprocess.run([ruff, "check", str(ROOT)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


def test_scheduler_and_cache_managers_do_not_import_torch():
    for name in ("request.py", "mm_window.py", "scheduler.py", "encoder_cache.py", "policy.py"):
        source = (ROOT / "engine" / name).read_text()
        assert "import torch" not in source, name
