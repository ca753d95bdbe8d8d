"""``tool_env`` + ``tool_agent_data``: a ReTool-style Python interpreter in a sandbox."""
