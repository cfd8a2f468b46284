import ast
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
    for name in ("engine/request.py", "engine/mm_window.py", "engine/scheduler.py", "engine/encoder_cache.py",
                 "engine/policy.py", "engine/commit.py", "audio/pauses.py", "engine/timeline.py",
                 "engine/words.py"):
        source = (ROOT / name).read_text()
        assert "import torch" not in source, name


MAX_FUNCTION_LINES = 80


def test_no_function_is_over_80_lines():
    long = []
    for folder in ("app", "audio", "engine", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long


def test_nothing_points_outside_the_repository():
    for path in [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("*/*.py")]:
        if path != Path(__file__).resolve():  # (this test names what it looks for)
            assert "../shared" not in path.read_text(), path
