"""Tunesmith studio: the PySide6 window over the engine. Only this package imports Qt.

Importing the package itself imports no Qt, so `tunesmith train ...` (studio.cli) stays
headless; studio.app applies the PySide6 guard in studio.qt_compat before any Qt call.
"""
