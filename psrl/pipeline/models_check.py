"""``psrl models check``: how closely transformers, the Megatron trainer, its export and a vLLM
engine agree on one model, as numbers.

``check_model`` runs these parts, in this order, on one ``MegatronTrainer`` (float32, CPU):

- ``hf_vs_megatron``: the logits of transformers (float32, eager attention) and of the trainer's
  GPTModel on fixed random ids, as padded rows and as one packed row of both documents (the
  trainer packs), compared on the same positions.
- ``train_step``: one small GRPO step, so the later parts run on weights that differ from the
  checkpoint (a sync or export that silently kept the checkpoint would then show).
- ``export_roundtrip``: ``save_checkpoint`` -> ``psrl.trainer.export.export_checkpoint`` ->
  transformers: the exported tensors are the trainer's bit for bit, with the source checkpoint's
  names and shapes, and the exported model's logits equal the trainer's (``export_tolerance``).
- ``engine_vs_trainer``: a vLLM engine gets the trainer's weights through the production weight
  sync (``DirectPublisher``), samples responses at temperature 1 with log-probs, and the trainer
  rescores them with ``compute_logprobs`` on trajectories built as the episode driver builds them.

A part that raises leaves its figures None and adds an error naming the part and the model; the
parts after it still run where they can. Figures are in ``ModelCheck``; its ``errors`` also hold
a failed export verdict.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .model_logits import fixed_sequences, hf_logits, max_abs_diff, megatron_logits

EXPORT_TOLERANCE = 1e-4  # max |logit difference| of an export against the trainer
PROMPT_LENGTHS = (8, 11, 13, 16)  # the engine part's prompts, one response each
RESPONSE_TOKENS = 24


@dataclass(frozen=True)
class ModelCheck:
    """What ``check_model`` measured; None where a part failed or did not run."""

    model: str
    family: str | None = None
    dtype: str = "float32"
    hf_vs_megatron_max_abs: float | None = None  # over the padded and the packed forward
    hf_vs_megatron_packed_max_abs: float | None = None  # the packed forward alone
    train_step_weight_max_abs_change: float | None = None
    export_roundtrip_ok: bool | None = None
    export_roundtrip_max_abs: float | None = None
    export_roundtrip_tolerance: float | None = None  # the bound export_roundtrip_max_abs was held to
    engine_vs_trainer_logprob_mean_abs: float | None = None
    engine_vs_trainer_logprob_max_abs: float | None = None
    engine_tokens: int | None = None  # sampled tokens the log-prob figures are over
    seconds: Mapping[str, float] = field(default_factory=dict)
    errors: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["seconds"], d["errors"] = dict(self.seconds), list(self.errors)
        return d


class _Parts:
    """Runs parts, timing each and turning a failure into an error naming the part and model."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.seconds: dict[str, float] = {}
        self.errors: list[str] = []

    def run(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - reported; the other parts still run
            self.fail(name, f"{type(exc).__name__}: {exc}")
            return None
        finally:
            self.seconds[name] = round(time.perf_counter() - start, 3)

    def fail(self, name: str, message: str) -> None:
        self.errors.append(f"{name} failed for model {self.model}: {message}")


def check_model(name_or_path: str, *, engine: bool | Any = True, seed: int = 0, lr: float = 1e-3) -> ModelCheck:
    """Measure ``name_or_path`` (an offline model name or a local HF directory).

    ``engine``: True starts a vLLM engine (float32, eager) for the engine part and closes it after;
    False skips that part; a running ``VLLMEngine`` on the same model is used as it is (its weights
    are then the trained ones: the caller restores them). Synchronous: do not call it from a
    running event loop. ``lr``: the learning rate of the one training step."""
    parts = _Parts(name_or_path)
    figures: dict[str, Any] = {}
    located = parts.run("architecture", _locate, name_or_path)
    if located is None:
        return ModelCheck(name_or_path, seconds=parts.seconds, errors=tuple(parts.errors))
    path, figures["family"] = located
    trainer = parts.run("trainer", _build_trainer, path, seed, lr)
    if trainer is None:
        return ModelCheck(name_or_path, **figures, seconds=parts.seconds, errors=tuple(parts.errors))
    try:
        seqs = fixed_sequences(trainer.arch.vocab_size, seed)
        got = parts.run("hf_vs_megatron", _hf_vs_megatron, trainer, path, seqs)
        if got is not None:
            figures["hf_vs_megatron_max_abs"], figures["hf_vs_megatron_packed_max_abs"] = got
        figures["train_step_weight_max_abs_change"] = parts.run("train_step", _train_step, trainer, seqs)
        tolerance = export_tolerance(figures.get("hf_vs_megatron_max_abs"))
        got = parts.run("export_roundtrip", _export_roundtrip, trainer, path, seqs, tolerance)
        if got is not None:
            ok, max_abs, problem = got
            figures.update(export_roundtrip_ok=ok, export_roundtrip_max_abs=max_abs, export_roundtrip_tolerance=tolerance)
            if problem:
                parts.fail("export_roundtrip", problem)
        if engine is not False:
            got = parts.run("engine_vs_trainer", engine_vs_trainer, trainer, path, engine, seed)
            if got is not None:
                (figures["engine_vs_trainer_logprob_mean_abs"], figures["engine_vs_trainer_logprob_max_abs"],
                 figures["engine_tokens"]) = got
    finally:
        trainer.close()
    return ModelCheck(name_or_path, **figures, seconds=parts.seconds, errors=tuple(parts.errors))


def _locate(name_or_path: str) -> tuple[str, str]:
    """The local directory and the trainer's family name (raises for an unsupported model)."""
    from psrl.models import resolve_model_path
    from psrl.trainer.model import HFArch

    path = resolve_model_path(name_or_path)
    return path, HFArch.from_pretrained(path).family


def _build_trainer(path: str, seed: int, lr: float):
    import warnings

    from psrl.config import OptimConfig, TrainerConfig
    from psrl.trainer.trainer import MegatronTrainer

    cfg = TrainerConfig(device="cpu", dtype="float32", seed=seed, optim=OptimConfig(lr=lr))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return MegatronTrainer(path, cfg)


def _hf_vs_megatron(trainer: Any, path: str, seqs: list[np.ndarray]) -> tuple[float, float]:
    ref = hf_logits(path, seqs)
    padded = max_abs_diff(ref, megatron_logits(trainer, seqs, "padded"))
    packed = max_abs_diff(ref, megatron_logits(trainer, seqs, "packed"))
    return max(padded, packed), packed


def _train_step(trainer: Any, seqs: list[np.ndarray]) -> float:
    """One GRPO step on two groups of two (rewards 0 and 1), on-policy log-probs; the largest
    change of any HF weight."""
    import torch

    from psrl.trajectory import Trajectory

    before = {n: t.clone() for n, t in trainer.hf_weights(torch.float32)}
    trajs = [Trajectory(key=f"k{i}", group_id=f"g{i // 2}", prompt_ids=s[:8], response_ids=s[8:24],
                        loss_mask=np.ones(16), logprobs=np.zeros(16), versions=np.zeros(16),
                        turn_bounds=[[0, 16]], turn_rewards=[float(i % 2)], reward=float(i % 2))
             for i, s in enumerate(seqs * 2)]
    for t, lp in zip(trajs, trainer.compute_logprobs(trajs), strict=True):
        t.logprobs = lp
    metrics = trainer.step(trajs)
    if metrics.get("update_ok") != 1.0:
        raise RuntimeError(f"the optimizer step was skipped (metrics {metrics})")
    return float(max((t - before[n]).abs().max() for n, t in trainer.hf_weights(torch.float32)))


def export_tolerance(hf_vs_megatron_max_abs: float | None) -> float:
    """How far an export's logits may be from the trainer's: transformers loads the export, so
    they agree no better than transformers and Megatron do on the same weights (float32 kernels
    sum in another order: ~1e-4 on SmolLM2-135M's 30 layers, ~4e-7 on the tiny models). A wrong
    tensor or config is off by far more; the tensors themselves are compared bit for bit."""
    return max(EXPORT_TOLERANCE, 2.0 * (hf_vs_megatron_max_abs or 0.0))


def _export_roundtrip(trainer: Any, path: str, seqs: list[np.ndarray], tolerance: float) -> tuple[bool, float, str | None]:
    """(ok, max |logit difference|, what differed or None)."""
    import torch
    from safetensors.torch import load_file

    from psrl.engines.weights import checkpoint_shapes
    from psrl.trainer.export import export_checkpoint

    with tempfile.TemporaryDirectory(prefix="psrl-models-check-") as tmp:
        step = trainer.save_checkpoint(str(Path(tmp) / "checkpoint"))
        out = export_checkpoint(step, Path(tmp) / "hf", path, dtype="float32")
        exported, source = checkpoint_shapes(str(out)), checkpoint_shapes(path)
        written = load_file(str(out / "model.safetensors"))
        max_abs = max_abs_diff(hf_logits(out, seqs), megatron_logits(trainer, seqs, "padded"))
    problems = []
    if exported != source:
        missing, extra = sorted(set(source) - set(exported)), sorted(set(exported) - set(source))
        reshaped = sorted(n for n in set(source) & set(exported) if source[n] != exported[n])
        problems.append(f"the export's tensors differ from the source checkpoint's (missing {missing[:5]}, "
                        f"extra {extra[:5]}, other shapes {reshaped[:5]})")
    changed = sorted(n for n, t in trainer.hf_weights(torch.float32) if n in written and not torch.equal(written[n], t))
    if changed:
        problems.append(f"{len(changed)} exported tensors are not the trainer's ({', '.join(changed[:5])})")
    if not max_abs <= tolerance:
        problems.append(f"the exported model's logits differ from the trainer's by {max_abs:.3g} (> {tolerance:.3g})")
    return not problems, max_abs, "; ".join(problems) or None


def engine_vs_trainer(trainer: Any, path: str, engine: bool | Any, seed: int) -> tuple[float, float, int]:
    """(mean, max |engine - trainer log-prob|, tokens) over responses an engine samples after a
    real weight sync from ``trainer`` (its adapters, when it serves them). ``engine`` True: one
    launched here on ``path``."""
    import anyio

    from psrl.engines import FinishReason
    from psrl.trajectory import Step, Trajectory

    limit = min(trainer.arch.vocab_size, _tokenizer_size(path))  # vLLM refuses prompt ids past its tokenizer
    rng = np.random.default_rng(seed + 1)
    prompts = [rng.integers(0, limit, n).astype(np.int32) for n in PROMPT_LENGTHS]
    owned = None
    if engine is True:
        from psrl.config.rollout import EngineConfig
        from psrl.engines.vllm_engine import VLLMEngine

        cfg = EngineConfig(max_model_len=512, cpu_kv_cache_gb=0.25, max_num_seqs=len(prompts), seed=seed)
        rank = trainer.cfg.lora.rank if trainer.serves_adapters else 0
        engine = owned = VLLMEngine.launch(path, cfg, dtype="float32", name="models-check", lora_rank=rank)
    try:
        version, results = anyio.run(_sync_and_sample, trainer, engine, prompts, seed)
    finally:
        if owned is not None:
            owned.close()
    trajs = []
    for i, (prompt, res) in enumerate(zip(prompts, results, strict=True)):
        if res.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH) or len(res.output_ids) == 0:
            raise RuntimeError(f"request {i} ended {res.finish_reason.value}: {res.error}")
        if (res.versions != version).any():
            raise RuntimeError(f"request {i} was served by versions {sorted(set(res.versions.tolist()))}, not {version}")
        trajs.append(Trajectory.from_steps(f"r{i}", f"g{i}", prompt, [Step(res.output_ids, res.logprobs, res.versions)]))
    ours = np.concatenate(trainer.compute_logprobs(trajs))
    diff = np.abs(np.concatenate([t.logprobs for t in trajs]) - ours)
    return float(diff.mean()), float(diff.max()), int(diff.size)


async def _sync_and_sample(trainer: Any, engine: Any, prompts: list[np.ndarray], seed: int):
    """Stream the trainer's weights into ``engine`` as a new version, then sample every prompt."""
    import anyio
    import torch

    from psrl.config import WeightSyncConfig
    from psrl.engines import GenerateRequest, SamplingParams
    from psrl.trainer.weight_sync import DirectPublisher

    version = engine.statistics().version + 1
    publisher = DirectPublisher(engine, WeightSyncConfig())
    try:
        await publisher.publish(list(trainer.hf_weights(torch.float32)), version, adapter=trainer.adapter_config())
    finally:
        await publisher.aclose()
    results: list[Any] = [None] * len(prompts)

    async def one(i: int) -> None:
        sampling = SamplingParams(temperature=1.0, max_tokens=RESPONSE_TOKENS, seed=seed + i)
        results[i] = await engine.generate(GenerateRequest(prompts[i], sampling))

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return version, results


def _tokenizer_size(path: str) -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(path))


def format_table(check: ModelCheck) -> str:
    """The figures as aligned ``key  value`` lines (``psrl models check`` without ``--json``)."""
    rows = [(k, v) for k, v in check.to_dict().items() if k not in ("seconds", "errors")]
    rows.append(("seconds", ", ".join(f"{k} {v:.1f}" for k, v in check.seconds.items())))
    width = max(len(k) for k, _ in rows)
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else "-" if v is None else str(v)  # noqa: E731
    return "\n".join(f"{k:<{width}}  {fmt(v)}" for k, v in rows)
