"""Why a candidate failed, in words a user can act on: an exception summarised as its cause.

Exporters and compilers wrap the real cause. `torch.onnx.export` raises a `ConversionError` whose first lines
are advice ("... Next steps:", "- If there is a missing ONNX function ..."), chained (`__cause__`) to the error
that names what could not be converted: "No ONNX function found for aten.unsqueeze.default ... complex-valued
input". `summarize` walks the chain and picks the line that names an operator, a dtype or a shape; `details`
keeps the whole text (every exception of the chain, every line, no traceback frames) for the report.

Known blind spots: the cause is found by patterns, not by understanding. A cause that names no operator, dtype
or shape falls back to the first line that is not advice, which may still be generic; `details` has the rest.
An exception raised `from None` hides its context, here as in Python's own traceback.
"""

from __future__ import annotations

import re

#: Longest summary: a report's note column stays readable, `details` has the rest.
MAX_SUMMARY = 300
#: Exceptions of a chain looked at (chains are a few deep; this only bounds a pathological one).
_MAX_CHAIN = 16

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
#: "<class 'torch.onnx._internal.exporter._errors.DispatchError'>: ..." -> "DispatchError: ..."
_CLASS_PREFIX = re.compile(r"<class '(?:[\w]+\.)*(\w+)'>")
#: "<OpOverload(op='aten.unsqueeze', overload='default')>" -> "aten.unsqueeze.default"
_OP_OVERLOAD = re.compile(r"<OpOverload\(op='([\w.]+)', overload='(\w+)'\)>")

_DTYPE = re.compile(
    r"\bcomplex\w*|\b(?:torch\.)?(?:b?float(?:8\w*|16|32|64)|u?int(?:4|8|16|32|64)|bool)\b"
    r"|\b(?:Float|Half|Double|BFloat16|Long|Int|Short|Byte|Bool|ComplexFloat|ComplexDouble)\b"
    r"|\bdtypes?\b|\bscalar type\b|\btensor\((?:[a-z]+\d*)\)",
    re.IGNORECASE,
)
_OPERATOR = re.compile(
    r"\b(?:aten|prims|onnx|quantized|torchvision|_operator)(?:::|\.)[A-Za-z_]\w*"
    r"|\btorch\.ops\.\w+|\bOpOverload\b|\bONNX function\b|\bop(?:erator|_type)?\s*[(='\"]\s*\w"
    r"|\bunsupported (?:op|operator|node)\b",
    re.IGNORECASE,
)
_SHAPE = re.compile(
    r"\bshapes?\b|\bsizes? mismatch\b|\bdimensions?\b|\btorch\.Size\(|\[\d+(?:, ?\d+)+\]|\(\d+, ?\d+(?:, ?\d+)*\)"
    r"|\b\d+x\d+\b",
    re.IGNORECASE,
)
#: Lines that say what to do next or where to look, never what went wrong.
_BOILERPLATE = re.compile(
    r"next steps|^- if |if there is (?:a|an) |create an error report|submit a pr|please (?:report|file|open)"
    r"|see the stack trace|refer to the (?:full )?stack trace|for more information|this is step \d"
    r"|torch_logs|torchdynamo_verbose|suppress this exception|^from user code|^traceback|^file \""
    r"|^#+ |^exception summary$|^[\W_]*$",
    re.IGNORECASE,
)


def chain(error: BaseException) -> list[BaseException]:
    """`error` and the exceptions it was raised from or while handling, outermost first (as Python prints
    them in reverse): `__cause__`, else `__context__` unless suppressed with `raise ... from None`."""
    found: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and len(found) < _MAX_CHAIN and not any(current is seen for seen in found):
        found.append(current)
        cause = current.__cause__
        current = cause if cause is not None else (None if current.__suppress_context__ else current.__context__)
    return found


def _lines(error: BaseException) -> list[str]:
    """The message's lines, without terminal colours, blank lines or surrounding spaces."""
    text = _ANSI.sub("", _safe_str(error))
    return [line.strip() for line in text.splitlines() if line.strip()]


def _tidy(line: str) -> str:
    line = _OP_OVERLOAD.sub(lambda m: f"{m.group(1)}.{m.group(2)}", line)
    return _CLASS_PREFIX.sub(lambda m: m.group(1), line)


def _score(line: str) -> int:
    """How much a line says about the cause: a dtype counts most (it is rarely incidental), then an operator,
    then a shape; 0 for advice and for lines that name none of them."""
    if _BOILERPLATE.search(line):
        return 0
    return 3 * bool(_DTYPE.search(line)) + 2 * bool(_OPERATOR.search(line)) + bool(_SHAPE.search(line))


def _name(error: BaseException) -> str:
    return type(error).__name__


def summarize(error: BaseException, limit: int = MAX_SUMMARY) -> str:
    """The cause of `error` in one line of at most `limit` characters.

    "ExcType: line", where the line is the one of the whole chain that names the most of a dtype, an operator,
    a shape (root cause first on ties, as it is the most specific), else the first line of the outermost
    exception that is not advice. When the line comes from a chained exception, its type is named too:
    "ConversionError (from DispatchError): No ONNX function found for aten.unsqueeze.default. ...".
    """
    errors = chain(error)
    best: tuple[int, BaseException, str] | None = None
    for depth in reversed(range(len(errors))):  # root cause first: it wins ties
        for line in _lines(errors[depth]):
            score = _score(line)
            if score and (best is None or score > best[0]):
                best = (score, errors[depth], line)
    if best is not None:
        source, line = best[1], best[2]
    else:
        source, line = error, ""
        for candidate in errors:
            line = next((text for text in _lines(candidate) if not _BOILERPLATE.search(text)), "")
            if line:
                source = candidate
                break
    line = _tidy(line)
    head = _name(error) if _name(source) == _name(error) else f"{_name(error)} (from {_name(source)})"
    if line.startswith(f"{_name(source)}: "):  # the line repeats the type (an exporter's summary does)
        line = line[len(_name(source)) + 2 :]
    text = f"{head}: {line}" if line else head
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


def details(error: BaseException) -> str:
    """The full text of `error` and of every exception in its chain, outermost first, each as "Type: message"
    (every line, terminal colours removed; no traceback frames)."""
    errors = chain(error)
    parts = []
    for index, item in enumerate(errors):
        text = _ANSI.sub("", _safe_str(item)).strip()
        if index == 0:
            head = _name(item)
        else:
            head = f"{'raised from' if errors[index - 1].__cause__ is item else 'while handling'} {_name(item)}"
        parts.append(f"{head}: {text}" if text else head)
    return "\n\n".join(parts)


def _safe_str(error: BaseException) -> str:
    try:
        return str(error)
    except Exception:  # a broken __str__ must not hide the error it describes
        return f"<{type(error).__name__} whose message could not be read>"
