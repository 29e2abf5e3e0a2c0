"""Tunesmith studio: the PySide6 window over the engine. Only this package imports Qt."""

from studio import qt_compat as _qt_compat

_qt_compat.apply()
