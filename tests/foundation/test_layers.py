"""Layers import downward only (DESIGN.md), and the bottom layers need no torch or vLLM."""

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "psrl"

# Rank of each top-level module/package; a module may import only equal or lower ranks.
RANKS = {
    "registry": 0, "config": 0, "trajectory": 0, "log": 0, "models": 0, "token_ids": 0, "allocator": 0,
    "environments": 1, "sandboxes": 1, "engines": 1, "transfer_queue": 1, "trainer": 1,
    "gateway": 2, "agent_loops": 3,
    "testing": 4, "pipeline": 5, "serve": 5, "sft": 5, "cli": 6,
}


def _imports(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("psrl."):
            yield node.module.split(".")[1], node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("psrl."):
                    yield alias.name.split(".")[1], node.lineno


def test_layers_import_downward_only():
    bad = []
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG)
        own = rel.parts[0].removesuffix(".py")
        if own == "__init__":
            continue
        assert own in RANKS, f"{rel}: add psrl.{own} to RANKS in this test"
        for target, line in _imports(path):
            if target in RANKS and RANKS[target] > RANKS[own]:
                bad.append(f"{rel}:{line} imports psrl.{target} (a higher layer)")
    assert not bad, "\n".join(bad)


def test_bottom_layers_import_without_torch_or_vllm():
    code = (
        "import sys; import psrl.config, psrl.trajectory, psrl.registry, psrl.allocator, psrl.environments, psrl.agent_loops, psrl.cli;"
        "bad = [m for m in ('torch', 'vllm', 'megatron', 'transformers') if m in sys.modules]; print(bad); sys.exit(bool(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
