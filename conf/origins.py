"""Who set each config key: the layer of each assignment (model default, embedded default, file,
override), quoted by every error that names a key."""

from collections.abc import Sequence

from .schema_checks import DERIVED

KeyPath = tuple[str, ...]


def origin_of(key: str, origins: dict[KeyPath, str]) -> str:
    path = tuple(key.split("."))
    for end in range(len(path), 0, -1):
        if path[:end] in origins:
            return origins[path[:end]]
    if key in DERIVED:
        source, *fallbacks = DERIVED[key]
        otherwise = "".join(f" (else {fallback})" for fallback in fallbacks)
        return f"unset, so it follows {source}{otherwise} from {origin_of(source, origins)}"
    return "the model default"


def origin_under(key: str, origins: dict[KeyPath, str]) -> str:
    """Who set a key, or for a free-form mapping the first entry set below it."""
    path = tuple(key.split("."))
    below = [origin for set_key, origin in origins.items() if set_key[: len(path)] == path]
    return below[0] if below else origin_of(key, origins)


def where_set(keys: Sequence[str], origins: dict[KeyPath, str]) -> str:
    """Where the keys of a cross-key error were set; keys left at their defaults are not listed."""
    set_by = [(key, origin_of(key, origins)) for key in keys]
    listed = [f"{key}: {origin}" for key, origin in set_by if origin != "the model default"]
    return f" [{'; '.join(listed)}]" if listed else ""
