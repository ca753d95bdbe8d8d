"""What a served model accepts as a weight update: its checkpoint's tensor names and shapes."""

from __future__ import annotations

from pathlib import Path


def checkpoint_shapes(model_path: str) -> dict[str, tuple[int, ...]]:
    """HF parameter names and shapes of the safetensors checkpoint in ``model_path`` (empty if none)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def check_update(update: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]]) -> None:
    """Raise ``ValueError`` naming every tensor of a weight update the served model cannot take.

    vLLM's in-place reload is not transactional: a bad tensor found halfway through leaves the
    model broken, so the whole update is checked before anything is loaded. A full update (every
    checkpoint tensor) is required for the same reason. ``lm_head.weight`` may be sent for a
    model with tied embeddings whose checkpoint omits it.
    """
    if not expected:
        return
    problems = []
    for name, shape in update.items():
        want = expected.get(name)
        if want is None and name == "lm_head.weight":
            want = expected.get("model.embed_tokens.weight")
        if want is None:
            problems.append(f"{name!r} is not a parameter of the served model")
        elif tuple(shape) != tuple(want):
            problems.append(f"{name!r} has shape {tuple(shape)}, the model's is {tuple(want)}")
    missing = sorted(set(expected) - set(update))
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        problems.append(f"missing {len(missing)} of the model's tensors ({', '.join(missing[:5])}{more})")
    if problems:
        raise ValueError("weight update refused: " + "; ".join(problems))
