"""Reading a config's YAML: a config file's text (a regular file of UTF-8, never a blocking FIFO)
and the YAML loader that reads it and every command-line override's value as verl's OmegaConf does."""

import os
import re
import stat
from pathlib import Path

import yaml

from .schema_common import ConfigError


class ConfigYamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader, but reading 1e-6 as a float as YAML 1.2 (and verl's OmegaConf) do, and
    refusing a key set twice in one mapping, as OmegaConf does (PyYAML keeps the last silently)."""

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self._checked: set[int] = set()

    def flatten_mapping(self, node) -> None:
        """Check each mapping for keys set twice as it was written, once, before PyYAML merges into it
        the keys a `<<` brings (which it may do before the mapping itself is built, when another
        mapping merges it); keys a merge brings may be set again: that is what merging is for."""
        if id(node) not in self._checked:
            self._checked.add(id(node))
            self._refuse_keys_set_twice(node)
        super().flatten_mapping(node)

    def _refuse_keys_set_twice(self, node) -> None:
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key: the safe loader says so itself
                return
            if duplicate:
                written = key_node.value if isinstance(key_node, yaml.ScalarNode) else key
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping",
                    node.start_mark,
                    f"key {written!r} is set twice",
                    key_node.start_mark,
                )
            seen.add(key)


# Numbers are YAML 1.2's: no '_' inside a number and no base-60 ints. YAML 1.1 (PyYAML's default)
# reads 0.5_2 as 0.52, 1_5 as 15 and 1:30 as 90, which would turn a rollout_is_threshold of
# 'lower_upper' into one number; written so, such a value stays text (and a key that wants a number
# says so). 1e-6 is a float, as in YAML 1.2 and verl's OmegaConf.
_NUMBER_TAGS = ("tag:yaml.org,2002:float", "tag:yaml.org,2002:int")
ConfigYamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in _NUMBER_TAGS]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
ConfigYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int",
    re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"),
    list("-+0123456789"),
)
ConfigYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9]+)\.[0-9]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9]+)(?:[eE][-+]?[0-9]+)
        |[-+]?\.[0-9]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def read_config_text(path: Path) -> str:
    """A config file's text: a regular file (a FIFO would block the read forever) of UTF-8 text."""

    def unreadable(why: str) -> ConfigError:
        return ConfigError(f"cannot read config file '{path}': {why}")

    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise unreadable(exc.strerror) from None
    try:
        mode = os.fstat(descriptor).st_mode
        if stat.S_ISDIR(mode):
            raise unreadable("Is a directory")
        if not stat.S_ISREG(mode):
            raise unreadable("not a regular file")
        chunks = []
        while chunk := os.read(descriptor, 1 << 20):
            chunks.append(chunk)
    except OSError as exc:
        raise unreadable(exc.strerror) from None
    finally:
        os.close(descriptor)
    try:
        return b"".join(chunks).decode()
    except UnicodeDecodeError as exc:
        raise unreadable(f"not UTF-8 text (byte {exc.start}: {exc.reason})") from None
