"""Names a package exports but imports only when first used (PEP 562), so importing the
package (and `zeroshard --help`) does not pay for torch.

    __getattr__, __dir__ = lazy_exports(__name__, globals(), {"Engine": "zeroshard.api", ...})

A home is a module path, or (module path, attribute) when the name there differs."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, namespace: dict[str, Any], homes: dict[str, str | tuple[str, str]]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, attr = home if isinstance(home, tuple) else (home, name)
        value = getattr(importlib.import_module(module), attr)
        namespace[name] = value  # the next lookup is an ordinary attribute
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *homes})

    return __getattr__, __dir__
