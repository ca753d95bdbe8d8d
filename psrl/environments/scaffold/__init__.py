"""``psrl envs new NAME``: the files of a new environment package, written from templates."""

from .writer import scaffold

__all__ = ["scaffold"]
