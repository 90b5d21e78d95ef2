"""Structured logs: one JSON object per line, the same keys on every line of every service.

    {"ts": "2025-01-31T12:00:00.123456Z", "level": "INFO", "service": "decode", "instance": "decode-1a2b3c4d",
     "rid": "9f2c...", "event": "finished", "fields": {"reason": "length", "output_tokens": 32, ...}}

``rid`` is the request id on every line about one request (``null`` otherwise). ``event`` names what
happened; a request's lifecycle events are, per service:

- router: ``received``, ``refused`` (a bad request: ``field``, ``message``), ``placed`` (prefill and decode
  instances, attempt), ``replaced`` (an instance did not take it: role, instance, kind, reason),
  ``prefill_done``, ``handoff_done``, ``first_token``, then ``finished`` / ``failed`` / ``aborted`` (reason);
- prefill: ``received``, ``prefill_done``, ``handoff_sent`` (or ``handoff_refused`` / ``handoff_failed``),
  ``finished`` (a request that ended at its first token) / ``failed`` / ``aborted`` (reason);
- decode: ``reserved`` (or ``refused``), ``handoff_received``, ``stream_attached``, ``first_token``, then
  ``finished`` / ``failed`` / ``aborted`` (reason);
- the engine loop (any engine service): ``failed`` for each request an engine error ended, ``step_done``
  (DEBUG) for each request a step finished.

Lines that are not events (a library's warning, an unexpected exception) have ``event`` ``"log"`` and the
text in ``fields.message`` (and ``fields.exception``). Services log through ``ServiceLog``, which stamps
``service`` and ``instance`` on each record, so several services in one process (tests, notebooks) keep
their lines apart; ``setup_logging`` installs the formatter for ``eyrie serve``.
"""

from __future__ import annotations

import json
import logging
import sys
import time


class JsonFormatter(logging.Formatter):
    """A record -> one JSON line (``service`` / ``instance`` default to the process's own)."""

    def __init__(self, service: str = "-", instance: str = "-"):
        super().__init__()
        self.service, self.instance = service, instance

    def format(self, record: logging.LogRecord) -> str:
        event = getattr(record, "event", None)
        fields = dict(getattr(record, "fields", None) or {})
        if event is None:
            event = "log"
            fields = {"message": record.getMessage(), "logger": record.name, **fields}
        if record.exc_info:
            fields["exception"] = self.formatException(record.exc_info)
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + \
            f".{int(record.created % 1 * 1e6):06d}Z"
        return json.dumps({"ts": ts, "level": record.levelname,
                           "service": getattr(record, "service", None) or self.service,
                           "instance": getattr(record, "instance", None) or self.instance,
                           "rid": getattr(record, "rid", None), "event": event, "fields": fields},
                          ensure_ascii=False, default=str)


class ServiceLog:
    """One service instance's log: ``log.event("finished", rid, reason="length", output_tokens=32)``."""

    def __init__(self, service: str, instance: str = "-"):
        self.service, self.instance = service, instance
        self.logger = logging.getLogger(f"eyrie.{service}")

    def event(self, event: str, rid: str | None = None, level: int = logging.INFO, exc_info=None, **fields) -> None:
        if self.logger.isEnabledFor(level):
            self.logger.log(level, event, exc_info=exc_info,
                            extra={"service": self.service, "instance": self.instance, "rid": rid or None,
                                   "event": event, "fields": fields})

    def debug(self, event: str, rid: str | None = None, **fields) -> None:
        self.event(event, rid, logging.DEBUG, **fields)

    def warning(self, event: str, rid: str | None = None, **fields) -> None:
        self.event(event, rid, logging.WARNING, **fields)

    def exception(self, event: str, rid: str | None = None, **fields) -> None:
        """At ERROR, with the current exception's traceback in ``fields.exception``."""
        self.event(event, rid, logging.ERROR, exc_info=True, **fields)


class _StderrHandler(logging.Handler):
    """Writes to whatever ``sys.stderr`` is when a line is logged (not the stream current at set-up, which a
    test harness or an embedding program may have swapped and closed since)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:
            self.handleError(record)


def setup_logging(level: str, role: str, instance: str = "-", stream=None) -> JsonFormatter:
    """JSON lines on stderr (or ``stream``) for this process; returns the formatter (set ``instance`` on it
    once the instance id is known)."""
    handler = logging.StreamHandler(stream) if stream is not None else _StderrHandler()
    formatter = JsonFormatter(role, instance)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    return formatter


__all__ = ["JsonFormatter", "ServiceLog", "setup_logging"]
