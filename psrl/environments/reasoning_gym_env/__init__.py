"""``reasoning_gym_env``: reasoning-gym's procedural generators as tasks, their scorers as rewards.

Rows come from ``psrl data reasoning-gym NAME --size N -o train.parquet`` (see :mod:`.data`);
the AgentData is the chat codec ``tool_agent_data``.
"""
