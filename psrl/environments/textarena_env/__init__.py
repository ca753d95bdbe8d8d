"""``textarena_env``: TextArena's multi-player text games, the policy as one player against a
fixed opponent; the AgentData is the chat codec ``tool_agent_data``."""
