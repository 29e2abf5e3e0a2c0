"""Data: sources (files, Hub, bundled demo), format detection and column mapping, chat
rendering with response-only masks, and best-fit-decreasing packing into PackedBatch rows."""
