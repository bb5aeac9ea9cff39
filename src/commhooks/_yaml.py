"""Reading a YAML configuration strictly: no key given twice, no nesting past a sane depth.

``yaml.safe_load`` keeps the last value of a key written twice in one mapping, so a typo'd
copy of an option silently overrides the intended one; and its composer recurses once per
level of nesting, so ``'{' * 5000`` ends in a bare ``RecursionError``. Both are refused here
with the file's name and the line, as ``ValueError``.
"""

from typing import IO, Any

__all__ = ["MAX_DEPTH", "load_strictly"]

MAX_DEPTH = 64
"""Deepest nesting of mappings and lists taken: a hook configuration needs two or three."""


def load_strictly(yaml: Any, text: "str | IO[str]", name: str | None = None) -> Any:
    """Parse one YAML document from ``text`` (a string or a readable file) with ``yaml``, the
    PyYAML module; ``name`` (a file's own by default) names it in the ``ValueError`` for a key
    given twice or nesting deeper than :data:`MAX_DEPTH`."""
    if name is None:
        name = str(getattr(text, "name", "<yaml text>"))
    loader = _strict_loader(yaml)(text)
    loader.name = name
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _where(mark: Any) -> str:
    return f"{mark.name}, line {mark.line + 1}"


def _strict_loader(yaml: Any) -> Any:
    """A ``SafeLoader`` subclass that refuses duplicate keys and deep nesting."""

    class StrictLoader(yaml.SafeLoader):  # type: ignore[misc]
        depth = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            self.depth += 1
            try:
                if self.depth > MAX_DEPTH:
                    mark = self.peek_event().start_mark
                    raise ValueError(
                        f"{_where(mark)}: the YAML is nested more than {MAX_DEPTH} levels deep; "
                        "a hook configuration is a flat mapping of options. Check the brackets."
                    )
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            first: dict[Any, Any] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    earlier = first.setdefault(key, key_node.start_mark)
                except TypeError:
                    continue  # an unhashable key: yaml's own check reports it
                if earlier is not key_node.start_mark:
                    raise ValueError(
                        f"{_where(key_node.start_mark)}: key {key!r} is given twice in one "
                        f"mapping (first on line {earlier.line + 1}); YAML would keep the "
                        "second silently. Keep one of them."
                    )
            return super().construct_mapping(node, deep=deep)

    return StrictLoader
