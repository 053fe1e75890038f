"""The package version, kept in one place (read by pyproject.toml and ``ftrt --version``)."""

__version__ = "0.1.0"
