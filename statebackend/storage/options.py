"""Storage options: fsspec's keyword arguments for a scheme, never shown in full.

They travel with a `Storage` (its children keep them) and to Spark executors
inside task parameters; ``repr`` and ``str`` show ``'***'`` for every secret, so
a logged task, config or storage names the options but leaks nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

# Option names whose values are secrets (fsspec/s3fs and botocore spellings).
SECRET_OPTIONS = frozenset({"key", "secret", "token", "password", "aws_access_key_id",
                            "aws_secret_access_key", "aws_session_token", "session_token"})


class StorageOptions(Mapping[str, Any]):
    """Read-only fsspec options of a storage root whose repr never shows a secret.

    Pickled with task parameters to Spark executors (in the closure, not in row
    data or logs).
    """

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[str, Any] | None = None) -> None:
        self._data = dict(data or {})

    def __getitem__(self, name: str) -> Any:
        return self._data[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and dict(self._data) == dict(other)

    def __hash__(self) -> int:  # an immutable value (dataclass fields may hash it)
        return hash(tuple(sorted(self._data)))

    def __reduce__(self) -> tuple[type[StorageOptions], tuple[dict[str, Any]]]:
        return (StorageOptions, (self._data,))

    def __repr__(self) -> str:
        return f"StorageOptions({_redacted(self._data)!r})"

    __str__ = __repr__

    def to_dict(self) -> dict[str, Any]:
        """A plain (deep) copy for fsspec."""
        return {k: dict(v) if isinstance(v, Mapping) else v for k, v in self._data.items()}


def _redacted(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: "***" if k in SECRET_OPTIONS and v else _redacted(v)
                for k, v in value.items()}
    return value
