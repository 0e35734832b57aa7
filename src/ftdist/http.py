"""torchft's ``torchft.http``: :class:`ftdist._http_base.DualStackHTTPServer`."""

from ftdist._http_base import DualStackHTTPServer as _IPv6HTTPServer

__all__ = ["_IPv6HTTPServer"]
