"""``psrl serve CONFIG``: the session gateway and its engines as a standalone server.

Any harness (an eval tool, a custom agent, mini-swe-agent, OpenCode) opens a session with the
admin token, points an OpenAI client at the session's base URL, and closes it; each closed
session's captured trajectories land in a parquet file.
"""

from .server import ServeInfo, serve

__all__ = ["ServeInfo", "serve"]
