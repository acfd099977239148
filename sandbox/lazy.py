"""``exports``: a package ``__init__`` that imports what it re-exports on first use
(``hwplugins.lazy``, where it lives so the plugins can use it without the sandbox)."""

from hwplugins.lazy import exports

__all__ = ["exports"]
