"""``openenv_env``: an OpenEnv environment server (openenv-core's reset/step protocol over a
WebSocket session) as a PSRL Environment; the AgentData is the chat codec ``tool_agent_data``."""
