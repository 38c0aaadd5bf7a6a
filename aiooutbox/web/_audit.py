"""The audit log in words: what each entry did, to how many, and the message a page
shows after an action ("Retried 2 dead events."). The entry's JSON stays one click away
on the audit page; nothing here trusts its shape (an entry written by an older
dashboard, or by hand, is described as far as it can be)."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["describe", "message"]

_NOUNS = {
    "dead retry": ("Retried", "retried", "dead event"),
    "dead purge": ("Purged", "purged", "dead event"),
    "events run": ("Ran", "ran", "waiting event"),
    "events cancel": ("Cancelled", "cancelled (deleted)", "waiting event"),
}


def _target(entry: dict[str, Any]) -> dict[str, Any]:
    try:
        target = json.loads(entry.get("target") or "{}")
    except (ValueError, RecursionError):
        return {}
    return target if isinstance(target, dict) else {}


def _events(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _which(target: dict[str, Any]) -> str:
    ids = target.get("ids")
    if isinstance(ids, list) and ids:
        shown = ", ".join(str(i) for i in ids[:10] if isinstance(i, int))
        return f" ({'id' if len(ids) == 1 else 'ids'} {shown}{', …' if len(ids) > 10 else ''})"
    criteria = target.get("filter")
    if isinstance(criteria, dict):
        named = "; ".join(f"{k} {v}" for k, v in criteria.items() if (k, v) != ("status", "dead"))
        named = named or "every one"
        upto = target.get("max_id")
        return f" matching {named}" + (f", up to id {upto}" if isinstance(upto, int) else "")
    return ""


def _limits(target: dict[str, Any]) -> str:
    parts = []
    if target.get("max_running") is not None:
        parts.append(f"at most {target['max_running']} running")
    if target.get("rate"):
        parts.append(f"rate {target['rate']}")
    return ", ".join(parts)


def _group_limits(target: dict[str, Any]) -> str:
    parts = []
    if isinstance(target.get("max_running"), int):
        parts.append(f"at most {target['max_running']} running")
    if isinstance(target.get("rate_text"), str) and target["rate_text"]:
        burst = target.get("burst")
        shown = f" in bursts of {burst:g}" if isinstance(burst, (int, float)) else ""
        parts.append(f"rate {target['rate_text']}{shown}")
    return ", ".join(parts)


def _group_limit(target: dict[str, Any], name: str) -> str:
    group = target.get("group")
    which = f"group {group} of {name}" if isinstance(group, str) else f"every group of {name}"
    limits = _group_limits(target)
    return f"limited {which}: {limits}" if limits else f"removed the limits of {which}"


def describe(entry: dict[str, Any]) -> str:
    """The entry as a sentence, after its actor: ``retried 2 dead events (ids 3, 4)``."""
    action = str(entry.get("action") or "")
    target = _target(entry)
    affected = entry.get("affected")
    n = affected if isinstance(affected, int) else 0
    if action in _NOUNS:
        _, verb, noun = _NOUNS[action]
        text = f"{verb} {_events(n, noun)}{_which(target)}"
        moved = target.get("keys_moved_on")
        if isinstance(moved, int) and moved:
            text += f"; {moved} ordering key{'' if moved == 1 else 's'} moved on"
        return text
    topic = target.get("topic")
    name = f"topic {topic}" if isinstance(topic, str) else "a topic"
    if action == "topic pause":
        return f"paused {name}"
    if action == "topic resume":
        return f"resumed {name}"
    if action == "topic limit":
        limits = _limits(target)
        return f"limited {name}: {limits}" if limits else f"removed the limits of {name}"
    if action == "group limit":
        return _group_limit(target, name)
    return f"{action} ({_events(n, 'row')})"


def message(entry: dict[str, Any]) -> str:
    """What a page says after the action: ``Retried 2 dead events.``"""
    action = str(entry.get("action") or "")
    affected = entry.get("affected")
    n = affected if isinstance(affected, int) else 0
    if action in _NOUNS:
        past, _, noun = _NOUNS[action]
        text = f"{past} {_events(n, noun)}"
        target = _target(entry)
        moved = target.get("keys_moved_on")
        if isinstance(moved, int) and moved:
            text += f"; {moved} ordering key{'' if moved == 1 else 's'} moved on"
        return text + "."
    sentence = describe(entry)
    return sentence[:1].upper() + sentence[1:] + "."
