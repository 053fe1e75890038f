"""ftrt inside the trainers people already use (docs/integrations.md).

Each module imports its trainer library when it is imported, never before: ``import ftrt`` needs
none of them. ``ftrt.integrations.hf``: the Hugging Face ``Trainer`` (and what builds on it).
"""
