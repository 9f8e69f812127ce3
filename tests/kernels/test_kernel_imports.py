"""The kernels package is the bottom layer: wire, engine and sender import it, so it imports no other
part of vllm_delta but `settings` (anything more would make an import cycle between packages)."""

import ast
from pathlib import Path

import vllm_delta.kernels

ALLOWED = ("vllm_delta.kernels", "vllm_delta.settings")


def test_kernels_import_only_themselves_and_settings():
    root = Path(vllm_delta.kernels.__file__).parent
    for src in root.glob("*.py"):
        for node in ast.walk(ast.parse(src.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for n in names:
                if n.startswith("vllm_delta"):
                    assert n.startswith(ALLOWED), f"{src.name} imports {n}"
