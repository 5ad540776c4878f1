"""Failure texts with anything that looks like an API key masked, before they are recorded.

A server may echo a request's `Authorization` header in its error body (an "invalid key: Bearer
sk-..." message), and that text would reach `last_reward_failure`, `summary.json` and the
trajectory store. `masked` is the one function every place that records a failure text calls: it
replaces the values of the keys this process knows (`register_secret`: an `openai` judge's key; the
variables `api_key_env` names), the values of environment variables named like keys (`*_KEY`,
`*_TOKEN`, `*_SECRET`, `*PASSWORD`: a process that never read the key still masks it), and text
shaped like a key (`sk-...`, `Bearer ...`) with `***`. Light to import: no asyncrl module below it.
"""

from __future__ import annotations

import os
import re
import threading

MASK = "***"
# Shorter values are left alone: masking "1" or "true" everywhere would garble the text and hide nothing.
MIN_SECRET_CHARS = 8
_KEY_SHAPED = re.compile(r"\bsk-[A-Za-z0-9_\-]{6,}|(?<=\bBearer )\s*[A-Za-z0-9_\-.=+/]{6,}", re.IGNORECASE)
_KEY_NAMED = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD)$", re.IGNORECASE)

_SECRETS: set[str] = set()
_LOCK = threading.Lock()


def register_secret(value: str | None) -> None:
    """Mask `value` in every failure text this process records from now on."""
    if value and len(value) >= MIN_SECRET_CHARS:
        with _LOCK:
            _SECRETS.add(value)


def register_secret_env(name: str) -> None:
    """Mask the value of the environment variable `name` (an endpoint's `api_key_env`), if set."""
    if name:
        register_secret(os.environ.get(name))


def _known_secrets() -> list[str]:
    with _LOCK:
        known = set(_SECRETS)
    known.update(value for name, value in os.environ.items()
                 if _KEY_NAMED.search(name) and len(value) >= MIN_SECRET_CHARS)
    return sorted(known, key=len, reverse=True)  # a key that contains another is masked whole


def masked(text: object) -> str:
    """`text` as a string, with every known key's value and every key-shaped word replaced by `***`."""
    out = str(text)
    for secret in _known_secrets():
        out = out.replace(secret, MASK)
    return _KEY_SHAPED.sub(MASK, out)
