"""The code's shape: no class in the packages is over 400 lines. One that grows past it does more than one job, and
is split by job (as ``serving/`` is: preparing, answers, logprobs)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGES = Path(__file__).resolve().parents[1] / "packages"
MAX_CLASS_LINES = 400


def test_no_class_is_over_400_lines() -> None:
    over = []
    for path in sorted(PACKAGES.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_CLASS_LINES:
                    over.append(f"{path.relative_to(PACKAGES)}:{node.lineno} {node.name} ({lines} lines)")
    assert not over, f"classes over {MAX_CLASS_LINES} lines; split them by job: {', '.join(over)}"
