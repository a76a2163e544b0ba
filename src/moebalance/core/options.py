"""Frozen option sets built from ``key=value`` parameters: a policy's config, a router's options."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from moebalance.core.errors import InputError

__all__ = ["Options"]


@dataclass(kw_only=True, frozen=True, slots=True)
class Options:
    """Base of a frozen, keyword-only option set, validated in ``__post_init__`` by each subclass."""

    #: What owns the options and what one option is called, for error messages.
    owner_kind: ClassVar[str] = "owner"
    option_word: ClassVar[str] = "option"

    @classmethod
    def from_params(cls, owner: str, params: Mapping[str, Any]) -> Options:
        """The options from ``params`` (e.g. parsed ``--set`` values); an unknown key names the known ones."""
        names = [f.name for f in dataclasses.fields(cls)]
        for key in params:
            if key not in names:
                hint = f"its {cls.option_word}s: {', '.join(names)}" if names else "it takes none"
                raise InputError(f"{cls.owner_kind} {owner!r} has no {cls.option_word} {key!r}; {hint}")
        return cls(**params)

    def as_params(self) -> dict[str, Any]:
        """The options as JSON values."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
