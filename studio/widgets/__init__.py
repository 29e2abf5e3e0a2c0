"""Reusable widgets: live charts, the token-mask view, the packing view, the step list."""
