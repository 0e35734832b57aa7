"""
OpenTelemetry log export
========================

torchft can ship the records of chosen loggers to an OpenTelemetry collector
(``torchft.otel``). The same switch works here: with ``FTDIST_USE_OTEL`` (or
torchft's ``TORCHFT_USE_OTEL``) set to anything but ``false``,
:func:`setup_logger` attaches an OTLP/HTTP exporter to a logger; otherwise it
does nothing. The exporter needs the ``opentelemetry-sdk`` and
``opentelemetry-exporter-otlp-proto-http`` packages, which ftdist does not
require; they are imported only when export is switched on.

``FTDIST_OTEL_RESOURCE_ATTRIBUTES_JSON`` (or
``TORCHFT_OTEL_RESOURCE_ATTRIBUTES_JSON``) names a JSON file mapping a logger
name to the resource attributes its records carry.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import warnings
from typing import Any

_ENABLE_VARS = ("FTDIST_USE_OTEL", "TORCHFT_USE_OTEL")
_ATTRIBUTE_VARS = ("FTDIST_OTEL_RESOURCE_ATTRIBUTES_JSON", "TORCHFT_OTEL_RESOURCE_ATTRIBUTES_JSON")

_lock = threading.Lock()
# logger name -> (provider, handler)
_PROVIDERS: dict[str, tuple[Any, logging.Handler]] = {}


def _env(names: tuple[str, ...]) -> str | None:
    for name in names:
        value = os.environ.get(name)
        if value is not None:
            return value
    return None


def enabled() -> bool:
    """Whether log export is switched on (``FTDIST_USE_OTEL``/``TORCHFT_USE_OTEL``).

    Returns:
        False when the variable is unset or ``false`` (torchft's rule), or
        ``0``/``no``/empty; True otherwise.
    """
    value = _env(_ENABLE_VARS)
    return value is not None and value.strip().lower() not in ("false", "0", "no", "")


def _resource_attributes(name: str) -> dict[str, Any]:
    path = _env(_ATTRIBUTE_VARS)
    if path is None:
        return {}
    with open(path) as f:
        attributes = json.load(f)
    value = attributes.get(name, {}) if isinstance(attributes, dict) else {}
    if not isinstance(value, dict):
        raise ValueError(f"{path}: the attributes of logger {name!r} must be a JSON object")
    return value


def setup_logger(name: str) -> None:
    """Export the records of logger ``name`` over OTLP/HTTP, if export is on.

    Does nothing when export is off (the default), or when ``name`` is
    already set up.

    Args:
        name: the ``logging`` logger's name.

    Raises:
        ImportError: export is on but the OpenTelemetry packages are missing
            (the message names them).
        OSError: the resource attributes file cannot be read.
        ValueError: the resource attributes file is not valid JSON, or the
            entry for ``name`` is not an object.
    """
    if not enabled():
        return
    with _lock:
        if name in _PROVIDERS:
            return
        try:
            from opentelemetry._logs import set_logger_provider
            from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
            from opentelemetry.sdk._logs import LoggerProvider, LoggingHandler
            from opentelemetry.sdk._logs.export import BatchLogRecordProcessor
            from opentelemetry.sdk.resources import Resource
        except ImportError as exc:
            raise ImportError(
                "log export is on (FTDIST_USE_OTEL/TORCHFT_USE_OTEL) but OpenTelemetry is "
                "missing: pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http"
            ) from exc
        provider = LoggerProvider(resource=Resource.create(attributes=_resource_attributes(name)))
        set_logger_provider(provider)
        provider.add_log_record_processor(BatchLogRecordProcessor(OTLPLogExporter(timeout=5)))
        with warnings.catch_warnings():
            # newer SDKs point to another package's handler; this one works
            warnings.simplefilter("ignore", DeprecationWarning)
            handler = LoggingHandler(level=logging.NOTSET, logger_provider=provider)
        logging.getLogger(name).addHandler(handler)
        _PROVIDERS[name] = (provider, handler)


def shutdown() -> None:
    """Flush and stop every exporter :func:`setup_logger` started, and detach them."""
    with _lock:
        providers = list(_PROVIDERS.items())
        _PROVIDERS.clear()
    for name, (provider, handler) in providers:
        logging.getLogger(name).removeHandler(handler)
        provider.shutdown()


__all__ = ["enabled", "setup_logger", "shutdown"]
