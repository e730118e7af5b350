"""JSON through msgspec when it is installed (an Airflow dependency), else the stdlib.

`fast_loads` decodes standard JSON about 2-7x faster than ``json.loads``, and refuses
what only the stdlib accepts (``NaN``, ``Infinity``, numbers beyond a float, lone
surrogates) with ValueError: callers that must read those (the JSON state codec) fall
back to ``json.loads``, callers that must refuse them (`_metadata`) refuse.
`pretty_json` writes a record people read: keys sorted, one item per line;
`compact_json` the compact text state values and JSON columns hold, and
`compact_json_bytes` the same value as UTF-8 bytes, through msgspec where that gives
back the very value (4x faster than the stdlib: JSON state values are encoded on every
update).
"""

from __future__ import annotations

import json
from typing import Any

# Compact JSON text (no spaces, non-ASCII as is): one encoder for every value, since
# json.dumps with these arguments builds a new one per call (the same text; the
# construction was a tenth of encoding a short list)
compact_json = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode

try:
    from msgspec.json import Decoder as _MsgspecDecoder
    from msgspec.json import Encoder as _MsgspecEncoder
    from msgspec.json import decode as _msgspec_decode
    from msgspec.json import encode as _msgspec_encode
    from msgspec.json import format as _msgspec_format

    def fast_loads(data: bytes) -> object:
        try:
            return _msgspec_decode(data)
        except RecursionError:
            raise  # deep nesting: decode_json names it as such
        except Exception as exc:  # noqa: BLE001 - msgspec.DecodeError: report as ValueError
            raise ValueError(str(exc)) from exc

    _encode_compact = _MsgspecEncoder().encode
    _decode_plain = _MsgspecDecoder().decode

    def compact_json_bytes(obj: Any) -> bytes:
        """``compact_json(obj)`` as UTF-8 (the same text but for a float's exponent,
        ``1e16`` for ``1e+16``; the same value). msgspec writes some values the stdlib
        writes differently or refuses: NaN and infinities as null, tuples as lists, dict
        keys that are not strings as strings, bytes, sets and dates as strings or lists.
        Such an ``obj`` does not decode back equal, so the stdlib writes it (or refuses
        it) as before."""
        try:
            data = _encode_compact(obj)
            if _decode_plain(data) == obj:
                return data
        except Exception:  # noqa: BLE001, S110 - what msgspec refuses, the stdlib decides
            pass
        return compact_json(obj).encode()

    def pretty_json(obj: Any) -> bytes:
        """``obj`` as JSON, keys sorted, indent 1. The stdlib's indenting encoder is pure
        Python (a tenth of a warm run's commit, for a record of 128 references);
        msgspec's is native (non-ASCII characters are written as UTF-8, not escaped; a
        float NaN or infinity as null: both valid JSON for every reader here)."""
        return _msgspec_format(_msgspec_encode(obj, order="sorted"), indent=1)
except ImportError:  # pragma: no cover - stdlib fallback
    def fast_loads(data: bytes) -> object:
        return json.loads(data)

    def compact_json_bytes(obj: Any) -> bytes:
        return compact_json(obj).encode()

    def pretty_json(obj: Any) -> bytes:
        return json.dumps(obj, indent=1, sort_keys=True).encode()
