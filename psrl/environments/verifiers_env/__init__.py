"""``verifiers_env``: a verifiers (v1 API, verifiers>=0.4) taskset's tasks, scored by the task's
own rubric (``@vf.reward`` / ``@vf.metric`` hooks and config-plugged rewards); the AgentData is the
chat codec ``tool_agent_data``."""
