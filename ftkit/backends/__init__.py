"""Device and communication adapters behind one protocol (see ``base.Backend``)."""

from ftkit.backends.base import Backend, CommGroup

__all__ = ["Backend", "CommGroup"]
