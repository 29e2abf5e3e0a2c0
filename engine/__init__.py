"""Tunesmith's training engine: Qt-free, driven by the CLI and by the studio window alike.

Public entry points: `engine.config.RunConfig`, `engine.train.session.TrainingSession` and the
event types in `engine.events`. Heavy libraries (torch, transformers) load lazily, so importing
this package is cheap.
"""

__version__ = "0.1.0"
