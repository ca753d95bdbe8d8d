"""Session-scoped OpenAI-compatible API with token capture."""
