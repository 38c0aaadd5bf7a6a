"""``python -m aiooutbox topics``: list topics, and pause, resume or limit them."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .. import admin
from .._admin.flow import has_claimable
from .._admin.records import TopicControl, TopicInfo
from .._values.limits import check_topic_name
from ..errors import InvalidArgument
from .args import LIST_LIMIT
from .connect import database
from .errors import CommandError, UsageError
from .options import add_command, add_database_options, add_logging_options
from .output import age, safe, table

__all__ = ["add_topics_command"]


def add_topics_command(commands: Any, prog: str) -> None:
    """Register ``topics`` on the ``python -m aiooutbox`` command parser."""
    top = add_command(
        commands,
        "topics",
        "list topics with their depth, lag, pause and limits; pause, resume or limit one",
        f"""
        {prog} topics
        {prog} topics show payments.charge
        {prog} topics pause payments.charge
        {prog} topics resume payments.charge
        {prog} topics limit payments.charge --max-running 5 --rate 50/s
        {prog} topics limit payments.charge --rate none
        {prog} topics history payments.charge
        """,
        """
        A paused topic is claimed by no consumer of this release, in any process, from
        the moment the command returns; running handlers finish and producers keep
        enqueueing. --max-running N: at most N of its events claimed at once across
        every consumer. --rate N/s|N/min|N/h: claims average at most that rate, in
        bursts of at most --burst events (default: a tenth of a second's worth, at
        least 1). none removes a limit. Controls live in the database and every change
        is logged with who made it (--actor, default user@host): see docs/flow-control.md.
        """,
    )
    top.set_defaults(func=cmd_topics_list)
    top.add_argument("--json", action="store_true", help="print JSON for scripts")
    add_database_options(top)
    add_logging_options(top, "warning")
    actions = top.add_subparsers(dest="action", metavar="ACTION")

    lst = add_command(actions, "list", "list every topic (the default)", f"{prog} topics list")
    lst.set_defaults(func=cmd_topics_list)
    lst.add_argument("--json", action="store_true", help="print JSON for scripts")
    _common(lst)

    show = add_command(
        actions,
        "show",
        "one topic, with its latest changes",
        f"{prog} topics show payments.charge --json",
    )
    show.set_defaults(func=cmd_topics_show)
    show.add_argument("topic", help="the topic")
    show.add_argument("--json", action="store_true", help="print JSON for scripts")
    _common(show)

    for name, func, summary in (
        ("pause", cmd_topics_pause, "stop every consumer from claiming a topic (or all)"),
        ("resume", cmd_topics_resume, "let consumers claim a paused topic again (or all)"),
    ):
        verb = add_command(
            actions,
            name,
            summary,
            f"{prog} topics {name} payments.charge\n{prog} topics {name} --all",
        )
        verb.set_defaults(func=func)
        which = verb.add_mutually_exclusive_group(required=True)
        which.add_argument("topic", nargs="?", help="the topic")
        which.add_argument("--all", action="store_true", help=f"{name} every topic")
        _actor(verb)
        _common(verb)

    limit = add_command(
        actions,
        "limit",
        "set or remove a topic's limits",
        f"""
        {prog} topics limit payments.charge --max-running 5
        {prog} topics limit payments.charge --rate 50/s --burst 10
        {prog} topics limit payments.charge --max-running none --rate none
        """,
    )
    limit.set_defaults(func=cmd_topics_limit)
    limit.add_argument("topic", help="the topic")
    limit.add_argument("--max-running", metavar="N|none", help="claimed at once, at most")
    limit.add_argument("--rate", metavar="N/s|N/min|N/h|none", help="claims per unit of time")
    limit.add_argument(
        "--burst",
        metavar="N",
        help="events a claim may take at once after "
        "a quiet spell (with a rate; default: a tenth of a second's worth)",
    )
    limit.add_argument(
        "--group-max-running", metavar="N|none", help="claimed at once, at most, per group"
    )
    limit.add_argument("--group-rate", metavar="N/s|N/min|N/h|none", help="claims per group")
    limit.add_argument("--group-burst", metavar="N", help="--burst, per group")
    limit.add_argument(
        "--group", metavar="NAME", help="the --group-* limits of this group only (an override)"
    )
    _actor(limit)
    _common(limit)

    hist = add_command(
        actions,
        "history",
        "the latest changes of the controls",
        f"{prog} topics history\n{prog} topics history payments.charge",
    )
    hist.set_defaults(func=cmd_topics_history)
    hist.add_argument("topic", nargs="?", help="only this topic")
    hist.add_argument(
        "--limit", type=LIST_LIMIT, metavar="N", default=20, help="default 20, at most 100000"
    )
    hist.add_argument("--json", action="store_true", help="print JSON for scripts")
    _common(hist)


def _common(parser: argparse.ArgumentParser) -> None:
    add_database_options(parser)
    add_logging_options(parser, "warning")


def _actor(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--actor",
        metavar="WHO",
        help="who makes the change, for the log (default: your user name @ this host)",
    )


def _where(args: argparse.Namespace) -> dict[str, str]:
    return {"schema": args.schema, "table": args.table}


def _state(c: TopicControl) -> str:
    parts = ["paused" if c.paused else "active"]
    if c.max_running is not None:
        parts.append(f"max running {c.max_running}")
    if c.rate_text is not None:
        parts.append(f"rate {c.rate_text} (burst {c.burst:g})")
    return ", ".join(parts)


def _row(t: TopicInfo) -> list[object]:
    c = t.control
    state = "paused" if c.paused else "paused (all)" if t.paused else "active"
    rate = "-" if c.rate_text is None else f"{c.rate_text} (burst {c.burst:g})"
    limit = "-" if c.max_running is None else c.max_running
    return [t.topic, state, t.queued, t.due, t.waiting, t.running, age(t.lag), limit, rate]


_HEADERS = ["TOPIC", "STATE", "QUEUED", "DUE", "WAITING", "RUNNING", "LAG", "MAX RUNNING", "RATE"]


async def cmd_topics_list(args: argparse.Namespace) -> int:
    async with database(args) as conn:
        found = await admin.topics(conn, **_where(args))
        everything = any(
            c.topic == "" and c.paused for c in await admin.topic_controls(conn, **_where(args))
        )
    if args.json:
        print(
            json.dumps(
                {"every_topic_paused": everything, "topics": [t.as_dict() for t in found]}, indent=2
            )
        )
        return 0
    print(table(_HEADERS, [_row(t) for t in found]) if found else "no topics")
    if everything:
        print("every topic is paused (topics resume --all)")
    return 0


async def cmd_topics_show(args: argparse.Namespace) -> int:
    name = _topic(args.topic)
    async with database(args) as conn:
        found = await admin.topic_info(conn, name, **_where(args))
        changes = await admin.flow_history(conn, name, limit=5, **_where(args))
        groups = await admin.group_stats(
            conn, name, top=_TOP_GROUPS, schema=args.schema, table=args.table
        )
        limits = await admin.group_limits(conn, name, **_where(args))
    if found is None:
        raise CommandError(f"no topic {name!r}: it has no unfinished events and no controls")
    if args.json:
        extra = {"groups": groups.as_dict(), "group_limits": [g.as_dict() for g in limits]}
        print(
            json.dumps(
                {**found.as_dict(), "changes": [c.as_dict() for c in changes], **extra},
                indent=2,
                ensure_ascii=False,
            )
        )
        return 0
    print(table(_HEADERS, [_row(found)]))
    for g in limits:
        print(_group_state(g))
    if groups.busiest:
        shown = ", ".join(f"{_group(g)} {n}" for g, n in groups.busiest)
        print(f"busiest groups (running): {shown}")
    if groups.waiting:
        shown = ", ".join(f"{_group(g)} {n} ({age(lag)})" for g, n, lag in groups.waiting)
        print(f"most waiting groups (due, oldest): {shown}")
    for c in changes:
        print(
            f"{c.at:%Y-%m-%d %H:%M:%S} {safe(c.actor)}: {c.action} "
            f"({json.dumps(c.before)} -> {json.dumps(c.after)})"
        )
    return 0


async def cmd_topics_pause(args: argparse.Namespace) -> int:
    return await _pause(args, pause=True)


async def cmd_topics_resume(args: argparse.Namespace) -> int:
    return await _pause(args, pause=False)


async def _pause(args: argparse.Namespace, *, pause: bool) -> int:
    name = None if args.all else _topic(args.topic)
    actor = _checked_actor(args.actor)
    async with database(args) as conn:
        if name is None:
            if pause:
                await admin.pause_all(conn, actor=actor, **_where(args))
                print("paused every topic")
            else:
                changed = await admin.resume_all(conn, actor=actor, **_where(args))
                print(f"resumed every topic ({len(changed)} pause(s) ended)")
            return 0
        before = await admin.topic_controls(conn, **_where(args))
        was = next((c for c in before if c.topic == name), TopicControl(name))
        change = admin.pause_topic if pause else admin.resume_topic
        now = await change(conn, name, actor=actor, **_where(args))
        if pause:
            await _note_unknown(conn, args, name)
        if any(c.topic == "" and c.paused for c in before) and not pause:
            print(
                f"{args.prog}: note: every topic is paused (topics resume --all)", file=sys.stderr
            )
    verb = "paused" if pause else "resumed"
    print(f"{verb} {name}" if was.paused != now.paused else f"{name} was already {verb}")
    return 0


async def cmd_topics_limit(args: argparse.Namespace) -> int:
    name = _topic(args.topic)
    changes: dict[str, Any] = {}  # max_running, rate, burst
    if args.max_running is not None:
        changes["max_running"] = _none_or(args.max_running, "--max-running", int)
    if args.rate is not None:
        changes["rate"] = None if args.rate.strip().lower() == "none" else args.rate
    if args.burst is not None:
        changes["burst"] = _none_or(args.burst, "--burst", float)
    grouped: dict[str, Any] = {}  # the same, per group
    if args.group_max_running is not None:
        grouped["max_running"] = _none_or(args.group_max_running, "--group-max-running", int)
    if args.group_rate is not None:
        grouped["rate"] = None if args.group_rate.strip().lower() == "none" else args.group_rate
    if args.group_burst is not None:
        grouped["burst"] = _none_or(args.group_burst, "--group-burst", float)
    for flag, limits in (("--rate", changes), ("--group-rate", grouped)):
        if "rate" in limits and limits["rate"] is None and limits.get("burst") is not None:
            burst = flag.replace("rate", "burst")
            raise UsageError(f"{burst} needs a rate: {flag} none removes the rate and its burst")
    if args.group is not None and (changes or not grouped):
        raise UsageError("--group takes only --group-max-running, --group-rate, --group-burst")
    if not (changes or grouped):
        raise UsageError("say which limit to change: --max-running, --rate or --burst")
    actor = _checked_actor(args.actor)
    async with database(args) as conn:
        try:
            if changes:
                now = await admin.limit_topic(
                    conn, name, actor=actor, schema=args.schema, table=args.table, **changes
                )
                print(f"{name}: {_state(now)}")
            if grouped:
                g = await admin.limit_groups(
                    conn,
                    name,
                    group=args.group,
                    actor=actor,
                    schema=args.schema,
                    table=args.table,
                    **grouped,
                )
                print(f"{name}: {_group_state(g)}")
        except (InvalidArgument, TypeError) as exc:
            raise UsageError(str(exc)) from None
        await _note_unknown(conn, args, name)
    return 0


_TOP_GROUPS = 5  # groups `topics show` lists


def _group(group: str | None) -> str:
    return "(ungrouped)" if group is None else repr(group)


def _group_state(g: admin.GroupLimit) -> str:
    who = "every group" if g.group is None else f"group {g.group!r}"
    if g.max_running is None and g.rate is None:
        return f"{who}: no limits of its own"
    limits = [f"at most {g.max_running} running"] if g.max_running is not None else []
    if g.rate_text is not None:
        limits.append(f"rate {g.rate_text} (burst {g.burst:g})")
    return f"{who}: " + ", ".join(limits)


async def cmd_topics_history(args: argparse.Namespace) -> int:
    name = None if args.topic is None else _topic(args.topic)
    async with database(args) as conn:
        changes = await admin.flow_history(conn, name, limit=args.limit, **_where(args))
    if args.json:
        print(json.dumps([c.as_dict() for c in changes], indent=2, ensure_ascii=False))
        return 0
    rows = [
        [
            f"{c.at:%Y-%m-%d %H:%M:%S}",
            c.topic or "(every topic)",
            c.action,
            c.actor,
            json.dumps(c.before),
            json.dumps(c.after),
        ]
        for c in changes
    ]
    print(table(["AT", "TOPIC", "ACTION", "BY", "BEFORE", "AFTER"], rows) if rows else "no changes")
    return 0


def _topic(text: str) -> str:
    try:
        return check_topic_name(text)
    except (InvalidArgument, TypeError) as exc:
        raise UsageError(str(exc)) from None


def _checked_actor(actor: str | None) -> str | None:
    if actor is not None and (not actor.strip() or len(actor) > 200):
        raise UsageError("--actor must be 1-200 characters")
    return actor


def _none_or(text: str, flag: str, kind: type[int] | type[float]) -> Any:
    if text.strip().lower() == "none":
        return None
    try:
        return kind(text)
    except ValueError:
        what = "a whole number" if kind is int else "a number"
        raise UsageError(f"{flag} must be {what} or none, got {text!r}") from None


async def _note_unknown(conn: Any, args: argparse.Namespace, name: str) -> None:
    if not await has_claimable(conn, name, **_where(args)):
        print(
            f"{args.prog}: note: {name} has no events waiting; the control applies to "
            "those that come",
            file=sys.stderr,
        )
