"""The error of a request that cannot be planned: every check a request passes raises it
(request.py, images.py), and every door answers it as the caller's mistake (HTTP 400, exit
code 2, an action's rejected result), naming the field."""

from __future__ import annotations


class RequestError(ValueError):
    """A request that cannot be planned; the message names the field and the problem, and
    `field` is that field's name (None when the request as a whole is wrong)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field
