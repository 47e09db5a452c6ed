"""A tiny name -> function registry shared by every algorithm family in this package."""

from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

from rlmegatron.plugins import is_plugin_reference, load_plugin

EntryT = TypeVar("EntryT", bound=Callable)


class UnknownNameError(LookupError):
    """Raised when a registry is asked for a name nobody registered."""


class Registry(Generic[EntryT]):
    """Maps names (and aliases) to functions of one family, e.g. advantage estimators."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, EntryT] = {}

    def register(self, *names: str) -> Callable[[EntryT], EntryT]:
        """Decorator registering a function under one or more names (aliases share the function)."""
        if not names:
            raise ValueError(f"register a {self.kind} under at least one name")

        def decorator(fn: EntryT) -> EntryT:
            for name in names:
                existing = self._entries.get(name)
                # Silently replacing an entry would change the maths behind a config string.
                if existing is not None and existing is not fn:
                    raise ValueError(f"{self.kind} {name!r} is already registered to {existing.__qualname__}")
                self._entries[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> EntryT:
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownNameError(
                f"unknown {self.kind} {name!r}; known: {', '.join(sorted(self._entries))}"
            ) from None

    def resolve(self, reference: str) -> EntryT:
        """The entry registered as `reference`, or the user's function for a plug-in `path/to/file.py:function`.

        Loading by reference works in any process (a trainer rank, a Ray worker), so a spec can name a
        plug-in that runs far from the driver that validated it.
        """
        return load_plugin(reference) if is_plugin_reference(reference) else self.get(reference)

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._entries))

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={list(self.names())})"
