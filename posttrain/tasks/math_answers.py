"""Math answers compared as math: pull the final answer out of a completion, read it (LaTeX or plain)
into a SymPy expression, and decide whether two answers are equal.

TRL's `accuracy_reward` does this with the `math-verify` package; posttrain does it itself with SymPy
(a dependency of torch), so the rewards need no extra. It covers the answers of usual math data:
integers and decimals (thousands separators, a trailing `.`), fractions (`\\frac`, `\\dfrac`, `\\tfrac`,
`\\frac12`, `a/b`), roots (`\\sqrt{x}`, `\\sqrt[n]{x}`), powers, `\\pi`, `\\infty`, percentages, units and
degree signs written with `\\text{...}` / `^\\circ`, `x = ...` answers, tuples and lists (compared in
order) and symbolic expressions (equal when their difference simplifies to 0). Intervals, matrices
and set-builder notation are not read: such gold answers make the rewards abstain (None).
"""

from __future__ import annotations

import re

__all__ = ["answers_equal", "extract_answer", "parse_answer"]

MAX_CHARS = 300  # longer answers are not read: simplification time grows quickly with size


def _braced(text: str, start: int) -> tuple[str, int] | None:
    """(content, end) of the {...} group opening at text[start] == "{", braces balanced; None if unclosed."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1:i], i + 1
    return None


def _last_boxed(text: str) -> str | None:
    found = None
    for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        group = _braced(text, m.end() - 1)
        if group is not None:
            found = group[0]
    return found


_MATH_SPANS = re.compile(r"\$\$(.+?)\$\$|\$(.+?)\$|\\\[(.+?)\\\]|\\\((.+?)\\\)", re.DOTALL)


def extract_answer(text: str, anchored: bool = True) -> str | None:
    """The final answer written in `text`: the last \\boxed{...}, else the last math span ($...$, $$...$$,
    \\(...\\), \\[...\\]); with anchored=False (a gold solution) the whole text when it has neither."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    spans = [next(g for g in m.groups() if g is not None) for m in _MATH_SPANS.finditer(text)]
    if spans:
        return spans[-1]
    return None if anchored else text


_DROP = (r"\left", r"\right", r"\displaystyle", r"\!", r"\,", r"\;", r"\:", r"\quad", r"\qquad", "$", r"\%", "%",
         r"^\circ", r"^{\circ}", r"\circ", r"\degree")
_WORDS = {r"\cdot": "*", r"\times": "*", r"\div": "/", r"\pi": " pi ", r"\infty": " oo ", r"\le": "<=",
          r"\ge": ">=", **{f"\\{f}": f" {f} " for f in ("ln", "log", "sin", "cos", "tan", "exp")}}


def _rewrite_commands(s: str) -> str:
    """\\frac / \\sqrt (braced or one-character arguments) -> plain arithmetic, innermost first."""
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}", s)  # \frac12
    s = re.sub(r"\\sqrt\s*(\d|[a-zA-Z])(?![a-zA-Z])", r"\\sqrt{\1}", s)  # \sqrt2
    while True:
        m = re.search(r"\\(frac|sqrt)\s*(\[[^\]]*\])?\s*\{", s)
        if m is None:
            return s
        first = _braced(s, m.end() - 1)
        if first is None:
            raise ValueError("unbalanced braces")
        body, end = first
        if m.group(1) == "sqrt":
            root = m.group(2)[1:-1] if m.group(2) else "2"
            s = f"{s[:m.start()]}(({body})**(1/({root}))){s[end:]}"
            continue
        rest = re.match(r"\s*\{", s[end:])
        second = _braced(s, end + rest.end() - 1) if rest else None
        if second is None:
            raise ValueError("\\frac without a denominator")
        s = f"{s[:m.start()]}(({body})/({second[0]})){s[second[1]:]}"


def _plain(latex: str) -> str:
    """A LaTeX answer as an expression SymPy's parser reads."""
    s = re.sub(r"\\(?:text|textbf|mathrm|mbox|operatorname)\s*\{[^{}]*\}", " ", latex)  # units and words
    for token in _DROP:
        s = s.replace(token, " ")
    for token, repl in _WORDS.items():
        s = re.sub(re.escape(token) + r"(?![a-zA-Z])", repl, s)
    s = _rewrite_commands(s)
    if "\\" in s:
        raise ValueError(f"unsupported LaTeX command in {latex!r}")
    s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s)  # 1,000 -> 1000
    s = s.replace("{", "(").replace("}", ")").replace("^", "**")
    return s.strip().rstrip(".").strip()


# what may reach SymPy's parser (which evaluates Python): arithmetic characters, and names that are one
# letter or a known function or constant, so text from a model can never name a Python builtin
_SAFE = re.compile(r"[\w\s+\-*/().,<>=!\[\]]*")
_NAMES = {"pi", "oo", "sqrt", "sin", "cos", "tan", "log", "ln", "exp", "E", "I"}


def _check_safe(s: str) -> None:
    if not _SAFE.fullmatch(s) or "__" in s:
        raise ValueError(f"characters SymPy is not given: {s!r}")
    names = [n for n in re.findall(r"[A-Za-z_]+", s) if len(n) > 1 and n not in _NAMES]
    if names:
        raise ValueError(f"unknown names {names}")


def _split_top(s: str, sep: str = ",") -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        depth += {"(": 1, "[": 1, ")": -1, "]": -1}.get(ch, 0)
        if ch == sep and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    return parts + [s[start:]]


def parse_answer(text: str):
    """`text` (a LaTeX or plain answer) as a tuple of SymPy expressions (one for a single answer); None when
    it cannot be read."""
    from sympy.parsing.sympy_parser import (convert_xor, implicit_multiplication_application, parse_expr,
                                            standard_transformations)

    if not text or len(text) > MAX_CHARS:
        return None
    try:
        s = _plain(text)
        if "=" in s and "<=" not in s and ">=" not in s:
            s = s.split("=")[-1]  # "x = 5": the value
        if len(s) > 1 and s[0] in "([" and s[-1] in ")]" and "," in s:
            s = s[1:-1]  # a tuple or list: its elements
        _check_safe(s)
        transformations = standard_transformations + (implicit_multiplication_application, convert_xor)
        values = tuple(parse_expr(part.strip(), transformations=transformations, evaluate=True)
                       for part in _split_top(s))
    except Exception:  # noqa: BLE001 - anything SymPy cannot read is "not parseable"
        return None
    return values if values else None


def _equal(a, b) -> bool:
    import sympy

    try:
        if a == b:
            return True
        difference = sympy.simplify(a - b)
        if difference == 0:
            return True
        x, y = complex(a.evalf()), complex(b.evalf())
        return abs(x - y) <= 1e-6 * max(1.0, abs(x), abs(y))
    except Exception:  # noqa: BLE001 - symbols that do not evaluate to numbers, relations, ...
        return False


def answers_equal(gold, answer) -> bool:
    """Whether two parsed answers (tuples from `parse_answer`) are equal element by element."""
    return gold is not None and answer is not None and len(gold) == len(answer) and \
        all(_equal(g, a) for g, a in zip(gold, answer))
