"""Wiring: rollout workers, trainer loop, sync/async modes, launchers."""
