"""The metric names a PromQL expression reads, and the names a ``/metrics`` page exports.

The chart's alerts and dashboard must name only series the operator exports;
these two pure functions let a test compare them.  ``metric_names`` is a
tolerant tokenizer, not a PromQL parser (promtool is not built here: it would
mean compiling the prometheus module and its service-discovery dependencies):
it drops strings, label matchers, range and subquery brackets, Grafana
variables (``$run``, ``${datasource}``, ``$__rate_interval``), numbers and
durations, keywords, the label lists of ``by``/``without``/``on``/``ignoring``/
``group_left``/``group_right``, and identifiers called as functions.  What is
left are metric names.  A ``{__name__="x"}`` matcher names ``x``.
"""

from __future__ import annotations

import re

#: Words of PromQL that are neither functions (followed by "(") nor metric names.
KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan",
                      "by", "without", "on", "ignoring", "group_left", "group_right",
                      "start", "end"})
#: Keywords followed by a parenthesised list of label names.
LABEL_LISTS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_NAME_MATCHER = re.compile(r"""__name__\s*=\s*(["'`])([A-Za-z_:][A-Za-z0-9_:]*)\1""")
_LABEL_VALUES = re.compile(r"^\s*label_values\s*\((.*)\)\s*$", re.DOTALL)
_INTERVAL_VARIABLE = re.compile(r"\$(?:__[A-Za-z_]+|\{__[A-Za-z_]+\})")
_CLOSING = {"{": "}", "[": "]", "(": ")"}


def _skip_string(text: str, i: int) -> int:
    """The index after the string literal opening at ``text[i]`` (or the end of text)."""
    quote = text[i]
    i += 1
    while i < len(text) and text[i] != quote:
        i += 2 if text[i] == "\\" and quote != "`" else 1
    return i + 1


def _skip_block(text: str, i: int) -> int:
    """The index after the bracketed block opening at ``text[i]``, strings respected."""
    stack = [_CLOSING[text[i]]]
    i += 1
    while i < len(text) and stack:
        char = text[i]
        if char in "\"'`":
            i = _skip_string(text, i)
            continue
        if char in _CLOSING:
            stack.append(_CLOSING[char])
        elif char == stack[-1]:
            stack.pop()
        i += 1
    return i


def _next_char(text: str, i: int) -> str:
    while i < len(text) and text[i].isspace():
        i += 1
    return text[i] if i < len(text) else ""


def _grouped(text: str, i: int) -> bool:
    """Whether ``by`` or ``without`` follows index ``i`` (the word before aggregates)."""
    while i < len(text) and text[i].isspace():
        i += 1
    match = _IDENT.match(text, i)
    return match is not None and match.group().lower() in {"by", "without"}


def _skip_other(expr: str, i: int) -> int:
    """The index after what starts at ``expr[i]`` when it cannot name a metric: space, a
    comment, a string, a range or subquery bracket, a Grafana variable, a number or
    duration, an operator (label matchers are handled by the caller)."""
    char, end = expr[i], i + 1
    if char == "#":
        newline = expr.find("\n", i)
        end = len(expr) if newline < 0 else newline
    elif char in "\"'`":
        end = _skip_string(expr, i)
    elif char == "[":
        end = _skip_block(expr, i)
    elif char == "$":  # a Grafana variable: $name or ${name...}
        match = _IDENT.match(expr, i + 1)
        end = _skip_block(expr, i + 1) if expr[i + 1:i + 2] == "{" else \
            match.end() if match else i + 1
    elif char.isdigit() or (char == "." and expr[i + 1:i + 2].isdigit()):
        while end < len(expr) and (expr[end].isalnum() or expr[end] in "._" or
                                   (expr[end] in "+-" and expr[end - 1] in "eE")):
            end += 1
    return end


def metric_names(expr: str) -> set[str]:
    """The metric names ``expr`` reads (never raises, whatever the text)."""
    names: set[str] = set()
    i = 0
    while i < len(expr):
        if expr[i] == "{":
            end = _skip_block(expr, i)
            names.update(m.group(2) for m in _NAME_MATCHER.finditer(expr, i, end))
            i = end
            continue
        match = _IDENT.match(expr, i)
        if match is None:
            i = _skip_other(expr, i)
            continue
        word, i = match.group(), match.end()
        following = _next_char(expr, i)
        if word.lower() in LABEL_LISTS:
            if following == "(":
                i = _skip_block(expr, expr.index("(", i))
        elif not (word.lower() in KEYWORDS or following == "(" or _grouped(expr, i)):
            names.add(word)  # else a keyword, a function, or an aggregation: sum by (x) (...)
    return names


def grafana_promql(query: str) -> str | None:
    """A Grafana Prometheus query as plain PromQL, for a real parser: a template
    variable's ``label_values(EXPR, label)`` becomes EXPR (None when it names no
    series), and Grafana's interval variables (``$__rate_interval``, ``${__range}``)
    a duration.  Variables inside label values are left: they are strings there."""
    match = _LABEL_VALUES.match(query)
    if match is not None:
        inner = match.group(1)
        depth, split = 0, -1
        for index, char in enumerate(inner):
            depth += char in "({["
            depth -= char in ")}]"
            if char == "," and depth == 0:
                split = index
        if split < 0:
            return None
        query = inner[:split]
    return _INTERVAL_VARIABLE.sub("5m", query)


def grafana_query_names(query: str) -> set[str]:
    """The metric names a Grafana Prometheus query reads (see :func:`grafana_promql`)."""
    promql = grafana_promql(query)
    return set() if promql is None else metric_names(promql)


def exposed_names(exposition: str) -> set[str]:
    """The series names in a Prometheus text exposition (what ``/metrics`` serves)."""
    names: set[str] = set()
    for raw in exposition.splitlines():
        line = raw.strip()
        if line.startswith("#"):
            continue
        if (match := _IDENT.match(line)) is not None:
            names.add(match.group())
    return names
