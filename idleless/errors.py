"""Errors shared by the engine core, the offline Engine and the server."""

from __future__ import annotations

from typing import Optional


class RequestError(ValueError):
    """A request that can never be served (bad parameters, empty or over-long prompt).

    ``code`` follows the OpenAI error object (e.g. ``context_length_exceeded``) and ``param`` names
    the offending field, so the server can turn it into a 400 without guessing.
    """

    def __init__(self, message: str, *, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
