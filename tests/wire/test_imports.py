"""The codec is shared with trainers: it must not pull in vLLM or torch.distributed."""

import ast
from pathlib import Path

import vllm_delta.wire

FORBIDDEN = ("vllm", "torch.distributed")
OWN = ("vllm_delta",)


def test_wire_imports_neither_vllm_nor_torch_distributed():
    root = Path(vllm_delta.wire.__file__).parent
    for src in [*root.glob("*.py"), root.parent / "diff.py"]:
        for node in ast.walk(ast.parse(src.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else ([node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            )
            for n in names:
                bad = any(n == f or n.startswith(f + ".") for f in FORBIDDEN) and not n.startswith(OWN)
                assert not bad, f"{src.name} imports {n}"
