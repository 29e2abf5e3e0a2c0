"""Conformance suite: real model families (upstream templates and vocabularies) for masks, rows,
preview and export. See README.md in this folder."""
