"""Public fakes and conformance checks, for PSRL's tests and its users'.

Also the pipeline model behind ``psrl bench pipeline``: ``latency_model`` (the stated model and its
bounds), ``sim_*`` (a simulated engine, rollout and trainer that follow it) and ``sim_calibrate``
(fitting it to a ``psrl train`` run's metrics)."""

from .conformance_env import ConformanceError, check_environment
from .conformance_queue import check_transfer_queue
from .conformance_sandbox import check_sandbox
from .scripted_engine import ScriptedEngine
from .toy_envs import ByteAgentData, CrashingEnv, EchoEnv, GuessNumberEnv

__all__ = [
    "ByteAgentData", "ConformanceError", "CrashingEnv", "EchoEnv", "GuessNumberEnv", "ScriptedEngine",
    "check_environment", "check_sandbox", "check_transfer_queue",
]
