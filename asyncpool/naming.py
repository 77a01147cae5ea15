"""Pool names (``name=``): the check of a name, and the log that carries it.

An engine often runs several pools in one process (a row pool and its page
pool; two page pools of a hybrid-attention model, sliding-window and full;
prefill and decode pools). A pool built with ``name="swa"`` shows it in its
``repr()`` and starts every line it logs (it, its ledgers, its overdue
checker, its fence watcher, its lifecycle) with ``pool 'swa': ``, so an
operator can tell which pool a warning is about. Each such record also
carries the name as an attribute, :data:`LOG_FIELD` (``asyncpool_pool``),
for handlers that write fields (JSON) rather than parse the message. A pool
without a name logs exactly what it logged before names existed: the plain
module logger, the same records, without that attribute (read it as
``getattr(record, "asyncpool_pool", None)``).

Only construction, ``repr()`` and the log paths read the name; the hot paths
(``alloc``, ``free``, ``admit``, ``kv.alloc``, ``kv.free``) never do.
"""

from __future__ import annotations

import logging
from typing import Any, TypeAlias

__all__ = [
    "LOG_FIELD",
    "MAX_NAME_LEN",
    "Log",
    "NamedLog",
    "check_name",
    "pool_log",
    "repr_head",
]

#: The longest name a pool takes (it starts every line the pool logs).
MAX_NAME_LEN = 64

#: The ``LogRecord`` attribute that holds a named pool's name on every line
#: it logs (``logging``'s ``extra``). Prefixed with the package's name, so it
#: clashes with no ``LogRecord`` attribute nor a field another library adds;
#: absent from the records of a pool without a name.
LOG_FIELD = "asyncpool_pool"


def check_name(name: object) -> str | None:
    """``name`` as a plain ``str``, or None; raises before anything is built.

    ``TypeError`` for anything but None or a ``str``; ``ValueError`` for an
    empty name, one longer than :data:`MAX_NAME_LEN` characters, and one
    with a character that is not printable (``str.isprintable``: control
    characters, newlines, tabs, Unicode line and paragraph separators,
    format characters such as bidirectional overrides), which could forge
    or hide log lines. A ``str`` subclass is taken as the plain ``str`` of
    its characters (its own ``__repr__`` or ``__format__`` never runs in a
    log line).
    """
    if name is None:
        return None
    if not isinstance(name, str):
        raise TypeError(f"name must be None or a str, got {type(name).__name__}")
    name = str.__str__(name)  # a plain str: a subclass's methods never run later
    if not name:
        raise ValueError("name must not be empty (None: no name)")
    if len(name) > MAX_NAME_LEN:
        raise ValueError(
            f"name must be at most {MAX_NAME_LEN} characters, got {len(name)}: {name[:20]!r}..."
        )
    if not name.isprintable():
        bad = next(c for c in name if not c.isprintable())
        raise ValueError(
            f"name must hold printable characters only (no control characters, newlines, "
            f"tabs or format characters: they could forge log lines), got {name!r} "
            f"with {bad!r}"
        )
    return name


class NamedLog:
    """A logger whose lines start with ``pool '<name>': ``.

    The methods a pool's log paths call (``debug``, ``info``, ``warning``,
    ``error``, ``exception``, ``isEnabledFor``), with the logger's own
    level check first: nothing is formatted, and no message string built,
    for a level that is off. The name goes in as an argument (``%r``), so a
    ``%`` in it is never read as a format. Records keep the logger's name
    (``asyncpool.deferral`` and so on) and the caller's function and line,
    and carry the name as the attribute :data:`LOG_FIELD` too (added to a
    caller's own ``extra``, if any; built only for a line that is logged).
    """

    __slots__ = ("logger", "name")

    def __init__(self, logger: logging.Logger, name: str) -> None:
        self.logger: logging.Logger = logger
        self.name: str = name

    def __repr__(self) -> str:
        return f"<NamedLog {self.logger.name} {self.name!r}>"

    def isEnabledFor(self, level: int) -> bool:  # logging.Logger's name
        return self.logger.isEnabledFor(level)

    def _emit(self, level: int, msg: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        logger = self.logger
        if logger.isEnabledFor(level):
            # Two frames of ours (this and the level's method) between the
            # caller and logging: the record names the caller.
            kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 2
            extra = kwargs.get("extra")
            kwargs["extra"] = (
                {LOG_FIELD: self.name} if extra is None else {**extra, LOG_FIELD: self.name}
            )
            logger.log(level, "pool %r: " + msg, self.name, *args, **kwargs)

    def debug(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self._emit(logging.DEBUG, msg, args, kwargs)

    def info(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self._emit(logging.INFO, msg, args, kwargs)

    def warning(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self._emit(logging.WARNING, msg, args, kwargs)

    def error(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self._emit(logging.ERROR, msg, args, kwargs)

    def exception(self, msg: str, *args: Any, exc_info: Any = True, **kwargs: Any) -> None:
        kwargs["exc_info"] = exc_info
        self._emit(logging.ERROR, msg, args, kwargs)


#: What a pool's parts log through: the module logger (no name) or a
#: :class:`NamedLog` over it.
Log: TypeAlias = logging.Logger | NamedLog


def pool_log(logger: logging.Logger, name: str | None) -> Log:
    """``logger`` itself for a pool without a name (its lines as they always
    were), else a :class:`NamedLog` that starts them with the name."""
    return logger if name is None else NamedLog(logger, name)


def repr_head(cls_name: str, name: str | None) -> str:
    """The start of a pool's ``repr()``: ``<KVPagePool `` or ``<KVPagePool 'swa' ``."""
    return f"<{cls_name} " if name is None else f"<{cls_name} {name!r} "
