"""Public fakes and conformance checks, for PSRL's tests and its users'."""

from .conformance_env import ConformanceError, check_environment
from .conformance_queue import check_transfer_queue
from .conformance_sandbox import check_sandbox
from .scripted_engine import ScriptedEngine
from .toy_envs import ByteAgentData, CrashingEnv, EchoEnv, GuessNumberEnv

__all__ = [
    "ByteAgentData", "ConformanceError", "CrashingEnv", "EchoEnv", "GuessNumberEnv", "ScriptedEngine",
    "check_environment", "check_sandbox", "check_transfer_queue",
]
