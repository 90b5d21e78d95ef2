"""The engine's errors, in a module below every other one of ``shared/`` (it imports none of them), so that
any module may raise them without importing what a request is."""

from __future__ import annotations


class RequestError(ValueError):
    """A request the engine refuses; ``field`` names the input at fault."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
