"""Small shared types with no heavy imports (the CLI's fast paths must not import torch)."""

from __future__ import annotations

Buffer = bytes | bytearray | memoryview
"""Bytes-like data handed between codecs, the persist and storage."""
