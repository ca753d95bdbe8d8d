"""Cross-section rules of a whole config: what one section alone cannot check.

- ``train_actor_rollout_ref`` (validation) runs on the training engines: its ``model`` and
  ``rollout.engine`` cannot differ from ``gen_actor_rollout_ref``'s. Keys left out are mirrored
  from the generation section (so ``psrl config show`` prints what is used); keys given with the
  same value are accepted; a different value is an error rather than silently ignored.
- The ``critic`` section is used only by ``algorithm.advantage=gae`` (values other than its defaults
  are an error otherwise).
- ``trainer.ppo_mini_batch_size`` counts groups of a batch: at most ``data.batch_size``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

if TYPE_CHECKING:
    from .schema import PSRLConfig

GEN, VAL = "gen_actor_rollout_ref", "train_actor_rollout_ref"


def _set_keys(section: BaseModel, prefix: str) -> dict[str, Any]:
    """Dotted paths (under ``prefix``) of the leaf keys given explicitly in ``section``."""
    out: dict[str, Any] = {}
    for name in section.model_fields_set:
        value = getattr(section, name)
        if isinstance(value, BaseModel):
            out.update(_set_keys(value, f"{prefix}.{name}"))
        else:
            out[f"{prefix}.{name}"] = value
    return out


def _flat(section: BaseModel, prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in type(section).model_fields:
        value = getattr(section, name)
        out.update(_flat(value, f"{prefix}.{name}") if isinstance(value, BaseModel) else {f"{prefix}.{name}": value})
    return out


def _mirror(cfg: PSRLConfig, part: str) -> None:
    """``VAL.<part>`` must equal ``GEN.<part>`` where given; then it becomes a copy of it."""
    *parents, leaf = part.split(".")
    gen_node, val_node = getattr(cfg, GEN), getattr(cfg, VAL)
    for p in parents:
        gen_node, val_node = getattr(gen_node, p), getattr(val_node, p)
    gen_sec, val_sec = getattr(gen_node, leaf), getattr(val_node, leaf)
    given = _set_keys(val_sec, f"{VAL}.{part}")
    for path, value in sorted(given.items()):
        gen_value: Any = gen_sec
        for key in path.split(".")[len(part.split(".")) + 1:]:
            gen_value = getattr(gen_value, key)
        if value != gen_value:
            gen_path = GEN + path[len(VAL):]
            raise ValueError(
                f"{path}={value!r} differs from {gen_path}={gen_value!r}: validation rollouts run on the "
                f"training engines ({GEN}.{part}), so {VAL}.{part} cannot be honoured; remove it or set it "
                f"equal (a '*.' override sets both)"
            )
    # Mirror without marking keys as given by the user (a copy of the generation section's).
    object.__setattr__(val_node, leaf, gen_sec.model_copy(deep=True))


def check_config(cfg: PSRLConfig) -> None:
    _mirror(cfg, "model")
    _mirror(cfg, "rollout.engine")
    if cfg.algorithm.advantage != "gae":
        # Keys given with their default value (a config written by `psrl config show`) change nothing.
        defaults = _flat(type(cfg.critic)(), "critic")
        given = sorted(k for k, v in _set_keys(cfg.critic, "critic").items() if v != defaults[k])
        if given:
            raise ValueError(
                f"{', '.join(given)} given but algorithm.advantage={cfg.algorithm.advantage}: the critic is "
                "only trained with algorithm.advantage=gae"
            )
    mini = cfg.trainer.ppo_mini_batch_size
    if mini is not None and mini > cfg.data.batch_size:
        raise ValueError(
            f"trainer.ppo_mini_batch_size={mini} is larger than the batch (data.batch_size={cfg.data.batch_size} "
            "groups): a mini-batch counts groups (prompts), at most the batch"
        )
