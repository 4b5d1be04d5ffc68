"""The kvspec-core release, in a module of its own so that any module can read it without
importing the package root (which imports nearly everything)."""

__version__ = "0.1.0"
