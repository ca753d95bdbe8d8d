"""The stated latency model behind the simulated engine, environment and trainer (a SIMULATION).

All times are simulated seconds; ``time_scale`` turns them into real seconds (0.02 runs a
simulated second in 20 ms of wall time), so the scheduling code runs for real, quickly.

- Engine: a request waits for one of ``engine_slots`` slots (continuous batching without
  slow-down up to that width), then takes ``prefill_s_per_token * prompt_tokens +
  decode_s_per_token * output_tokens``. With ``engine_saturation`` > 0 the engine's total token
  rate stops growing at that many requests decoding at once: with n > ``engine_saturation`` each
  runs n / ``engine_saturation`` times slower (a CPU engine, or a compute-bound GPU one). Output
  length per turn is heavy-tailed: log-normal with median ``median_tokens`` and shape ``sigma``,
  clipped to ``[1, max_tokens]``. With ``resume_prefill`` a request held by a pause (a weight
  update, or a colocated trainer step) prefills its prompt and tokens so far again on resume, as
  the vLLM engine does: it aborts the running requests and resubmits them, recomputing their KV
  with the new weights. Pausing an engine that has requests running takes ``pause_s`` +
  ``pause_s_per_request`` x those requests (vLLM aborts them and clears its caches); an idle one
  pauses at once.
- Episode: ``turns`` uniform in ``[1, max_turns]``; after every turn but the last the environment
  answers after an exponential delay of mean ``env_mean_s`` with ``obs_tokens`` tokens.
- Episode: ``episode_overhead_s`` more per episode for what is neither generation nor env latency
  (reset, reward, tokenization, the trip through the queue to the trainer).
- Trainer: a step takes ``train_fixed_s + train_s_per_token * tokens`` (prompt + response tokens
  of the batch) plus ``step_overhead_s`` of bookkeeping; publishing weights takes ``weight_sync_s``.
- Hardware: with ``shared_hardware`` the engine and the trainer run on the same cores, so while
  both are busy each runs ``contention`` times slower (2.0: two CPU-bound parts on the same cores
  each get half). A colocated placement (the scheduler pauses generation while the trainer steps)
  avoids that overlap; a separate placement on shared hardware pays it.

The defaults describe a long-tailed multi-turn agentic workload on separate hardware; they are
assumptions, not measurements. ``psrl.testing.sim_calibrate.fit_latency_model`` fits every field
from a ``psrl train`` run's metrics.jsonl instead.

``throughput_bound`` gives the samples/s that this model allows per mode, the denominator of the
benchmark's ``efficiency``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class LatencyModel:
    median_tokens: float = 200.0
    sigma: float = 1.0
    max_tokens: int = 2048
    prompt_tokens: int = 64
    obs_tokens: int = 32
    max_turns: int = 4
    decode_s_per_token: float = 0.005
    prefill_s_per_token: float = 0.0001
    resume_prefill: bool = True
    pause_s: float = 0.0
    pause_s_per_request: float = 0.0
    engine_slots: int = 256
    engine_saturation: float = 0.0  # 0: never saturates (up to engine_slots)
    env_mean_s: float = 0.5
    train_fixed_s: float = 2.0
    train_s_per_token: float = 0.0001
    weight_sync_s: float = 0.1
    episode_overhead_s: float = 0.0
    step_overhead_s: float = 0.0
    shared_hardware: bool = False
    contention: float = 2.0
    failure_rate: float = 0.0  # probability that an env step raises (fault injection)
    time_scale: float = 0.02

    def describe(self) -> dict[str, float]:
        return asdict(self)

    # ---- draws (simulated seconds / tokens) ----------------------------------------------

    def draw_tokens(self, rng: np.random.Generator, max_tokens: int | None = None) -> int:
        cap = min(self.max_tokens, max_tokens or self.max_tokens)
        return int(np.clip(round(self.median_tokens * math.exp(self.sigma * rng.standard_normal())), 1, cap))

    def draw_turns(self, rng: np.random.Generator) -> int:
        return int(rng.integers(1, self.max_turns + 1))

    def draw_env_s(self, rng: np.random.Generator) -> float:
        return float(rng.exponential(self.env_mean_s)) if self.env_mean_s > 0 else 0.0

    def generate_s(self, prompt_tokens: int, output_tokens: int) -> float:
        return self.prefill_s_per_token * prompt_tokens + self.decode_s_per_token * output_tokens

    def train_s(self, tokens: int) -> float:
        return self.train_fixed_s + self.train_s_per_token * tokens

    def saturation_factor(self, decoding: int) -> float:
        """How much slower each request decodes while ``decoding`` requests decode at once."""
        if self.engine_saturation <= 0 or decoding <= self.engine_saturation:
            return 1.0
        return decoding / self.engine_saturation

    def overlap_factor(self, other_busy: bool) -> float:
        """How much slower the engine or the trainer runs while the other one is busy too."""
        return self.contention if self.shared_hardware and other_busy else 1.0

    # ---- the bound -----------------------------------------------------------------------

    def sample_episode(self, rng: np.random.Generator) -> tuple[float, int]:
        """(duration in simulated seconds without queueing for a slot, tokens in the sample)."""
        turns = self.draw_turns(rng)
        duration, context = self.episode_overhead_s, self.prompt_tokens
        for t in range(turns):
            out = self.draw_tokens(rng)
            duration += self.generate_s(context, out)
            context += out
            if t < turns - 1:
                duration += self.draw_env_s(rng)
                context += self.obs_tokens
        return duration, context

    def throughput_bound(
        self,
        *,
        groups_per_step: int,
        group_size: int,
        mode: str,
        tokens_per_sample: float | None = None,
        colocated: bool = False,
        draws: int = 4000,
        seed: int = 0,
    ) -> dict[str, float]:
        """Samples/s (simulated) that no scheduler can beat under this model.

        sync: generation and training alternate, so a step lasts the slowest group of its batch
        (expected maximum over the batch, by Monte Carlo) plus train and weight sync. Otherwise
        the pipeline overlaps them: the bound is the smaller of the trainer's rate and the
        engine's (``engine_slots`` episodes at a time, or ``engine_saturation`` episodes' worth of
        decoding when that is smaller). ``tokens_per_sample``: the mean size of the
        samples actually trained on, when known (a staleness bound drops long-tailed samples, which
        makes the trainer's batches smaller than the model's mean). ``colocated``: generation
        pauses while the trainer steps, so overlapped modes add engine time to trainer time.
        """
        rng = np.random.default_rng(seed)
        per_step = groups_per_step * group_size
        eps = [self.sample_episode(rng) for _ in range(draws)]
        durations = np.array([d for d, _ in eps])
        tokens = np.array([k for _, k in eps], np.float64)
        mean_tokens = tokens.mean() if tokens_per_sample is None else tokens_per_sample
        step_train = self.train_s(int(mean_tokens * per_step)) + self.step_overhead_s + self.weight_sync_s
        trainer_rate = per_step / step_train
        width = min(self.engine_slots, self.engine_saturation) if self.engine_saturation > 0 else self.engine_slots
        engine_rate = width / durations.mean()
        if colocated and mode != "sync":
            # Generation is paused while the trainer steps: only the gaps between steps generate.
            bound = 1.0 / (1.0 / trainer_rate + 1.0 / engine_rate)
            return {"samples_per_s": bound, "trainer_rate": trainer_rate, "engine_rate": engine_rate,
                    "mean_episode_s": float(durations.mean()), "train_step_s": step_train}
        if self.shared_hardware and mode != "sync":
            # One set of cores does both jobs: while they overlap each runs `contention` times
            # slower, so with contention 2 overlapping hides idle time but adds no speed.
            t_train, t_engine = 1.0 / trainer_rate, 1.0 / engine_rate
            per_sample = max(t_train, t_engine, (t_train + t_engine) * self.contention / 2)
            return {"samples_per_s": 1.0 / per_sample, "trainer_rate": trainer_rate,
                    "engine_rate": engine_rate, "mean_episode_s": float(durations.mean()), "train_step_s": step_train}
        if mode == "sync":
            trials = max(1, draws // per_step)
            slowest = durations[: trials * per_step].reshape(trials, per_step).max(axis=1).mean()
            bound = per_step / (slowest + step_train)
        else:
            bound = min(trainer_rate, engine_rate)
        return {"samples_per_s": bound, "trainer_rate": trainer_rate, "engine_rate": engine_rate,
                "mean_episode_s": float(durations.mean()), "train_step_s": step_train}
