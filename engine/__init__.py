"""Tunesmith's training engine: Qt-free, driven by the CLI and by the studio window alike.

Public entry points: `engine.config.RunConfig`, `engine.train.session.TrainingSession` and the
event types in `engine.events`. Heavy libraries (torch, transformers) load lazily, so importing
this package is cheap. Importing it changes nothing in the process (the CUDA allocator's setting
is the entry points' call: engine.allocator).
"""

__version__ = "0.1.0"
