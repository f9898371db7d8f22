"""A tiny name -> function registry, so a config string selects an algorithm."""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

F = TypeVar("F")


class Registry(Generic[F]):
    """Maps names to functions (or any value: the model architectures); unknown names fail
    with the list of valid ones."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def decorator(fn: F) -> F:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> F:
        try:
            return self._items[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; valid: {', '.join(sorted(self._items))}") from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items
