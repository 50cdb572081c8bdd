"""Test assertions parsed and judged on the host: the half of the code reward no program ever runs.

`parse_test` splits a row's test into its setup, the calls only the program can make (*leaves*,
evaluated in the sandbox and sent back as ``repr``) and an expression over them. `read_value`
reads a leaf's reported value with a bounded literal parser (size, node and depth limits), and
`judge` evaluates the expression over those values with the few pure operations it allows. So a
program is never told what a leaf should be, and nothing it prints can pass a test it did not
compute (polo.rewards.code).
"""

from __future__ import annotations

import ast
import math
import operator
from dataclasses import dataclass

MAX_VALUE_CHARS = 10_000
_MAX_VALUE_NODES = 10_000
_MAX_VALUE_DEPTH = 64
# Arithmetic on values the program chose must not hang or exhaust the trainer.
_MAX_INT_BITS = 1 << 16
_MAX_SEQUENCE = 1 << 20

_PURE_FUNCTIONS = {
    "abs": abs,
    "all": all,
    "any": any,
    "bool": bool,
    "dict": dict,
    "float": float,
    "frozenset": frozenset,
    "int": int,
    "isinstance": isinstance,
    "len": len,
    "list": list,
    "max": max,
    "min": min,
    "round": round,
    "set": set,
    "sorted": sorted,
    "str": str,
    "sum": sum,
    "tuple": tuple,
    "type": type,
}
_PURE_NAMES = {**_PURE_FUNCTIONS, "complex": complex, "bytes": bytes, "NoneType": type(None)}
_MATH = {
    "isclose": math.isclose,
    "fabs": math.fabs,
    "sqrt": math.sqrt,
    "floor": math.floor,
    "ceil": math.ceil,
    "inf": math.inf,
    "pi": math.pi,
    "e": math.e,
}
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.BitAnd: operator.and_,
    ast.BitOr: operator.or_,
    ast.BitXor: operator.xor,
    ast.LShift: operator.lshift,
    ast.RShift: operator.rshift,
}
_COMPARE = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}
_UNARY = {ast.Not: operator.not_, ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Invert: operator.invert}
LEAF_PREFIX = "__polo_leaf_"


class TestFormatError(ValueError):
    __test__ = False  # not a pytest test class, despite the name

    """A test the code reward cannot judge (not valid Python, or not ending in an assert)."""


class LeafError(Exception):
    """A leaf whose evaluation raised in the sandbox, or whose value could not be read back."""


class UnreadableValue(LeafError):
    """A leaf value that is not a small Python literal: a wrong answer (nothing else is comparable)."""


@dataclass(frozen=True)
class ParsedTest:
    """One test: ``setup`` statements and ``leaves`` run in the sandbox, ``check`` is judged here.

    ``expression``/``expected`` are set for the plain ``assert <expression> == <literal>`` form.
    """

    source: str
    setup: tuple[str, ...]
    leaves: tuple[str, ...]
    check: ast.Expression
    expression: str | None = None
    expected: object = None


def parse_test(test: str) -> ParsedTest:
    """Return the parsed form of one test: setup statements then an assert (TestFormatError otherwise)."""
    if not isinstance(test, str):
        raise TestFormatError(f"a test must be a string holding an assert statement, got {test!r:.80}")
    try:
        body = ast.parse(test).body
    except (SyntaxError, ValueError, MemoryError, RecursionError) as exc:
        raise TestFormatError(f"test {test!r:.80} is not valid Python: {getattr(exc, 'msg', exc)}") from exc
    if not body or not isinstance(body[-1], ast.Assert):
        raise TestFormatError(f"test {test!r:.80} must end with an assert statement")
    expression = expected = None
    node = body[-1].test
    if len(body) == 1 and isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq):
        try:
            expected = ast.literal_eval(node.comparators[0])
            expression = ast.unparse(node.left)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            expected = None
    leaves: list[str] = []
    check = ast.Expression(_lift(node, leaves))  # rewrites the tree: after reading the plain form above
    ast.fix_missing_locations(check)
    return ParsedTest(test, tuple(ast.unparse(s) for s in body[:-1]), tuple(leaves), check, expression, expected)


def _is_pure_call(node: ast.Call) -> bool:
    """Return whether a call is one of the pure functions the parent evaluates itself."""
    func = node.func
    named = isinstance(func, ast.Name) and func.id in _PURE_FUNCTIONS
    in_math = (
        isinstance(func, ast.Attribute)
        and isinstance(func.value, ast.Name)
        and func.value.id == "math"
        and func.attr in _MATH
    )
    plain_args = not any(isinstance(a, ast.Starred) for a in node.args) and all(k.arg for k in node.keywords)
    # `len(stack)` or `isinstance(x, Node)`: an argument that names one of the program's objects
    # cannot come back as a literal, so the whole call is the program's to evaluate.
    values = [*node.args, *(k.value for k in node.keywords)]
    names_an_object = any(
        (isinstance(v, ast.Name) and v.id not in _PURE_NAMES)
        or (isinstance(v, ast.Attribute) and not (isinstance(v.value, ast.Name) and v.value.id == "math"))
        for v in values
    )
    return (named or in_math) and plain_args and not names_an_object


def _lift(node: ast.expr, leaves: list[str]) -> ast.expr:
    """Return ``node`` with every part only the program can compute replaced by a leaf name."""

    def leaf() -> ast.expr:
        leaves.append(ast.unparse(node))
        return ast.Name(id=f"{LEAF_PREFIX}{len(leaves) - 1}", ctx=ast.Load())

    if isinstance(node, ast.Constant):
        return node
    if isinstance(node, ast.Name):
        return node if node.id in _PURE_NAMES else leaf()
    if isinstance(node, ast.Attribute):
        simple = isinstance(node.value, ast.Name) and node.value.id == "math" and node.attr in _MATH
        return node if simple else leaf()
    if isinstance(node, ast.Call) and not _is_pure_call(node):
        return leaf()
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(isinstance(e, ast.Starred) for e in node.elts):
        return leaf()
    if isinstance(node, ast.Dict) and any(key is None for key in node.keys):
        return leaf()
    lifted_types = (
        ast.Call,
        ast.Tuple,
        ast.List,
        ast.Set,
        ast.Dict,
        ast.UnaryOp,
        ast.BinOp,
        ast.BoolOp,
        ast.Compare,
        ast.IfExp,
        ast.Subscript,
        ast.Slice,
        ast.keyword,
    )
    if not isinstance(node, lifted_types):
        return leaf()
    for name, value in ast.iter_fields(node):
        if isinstance(value, ast.expr) and name != "func":
            setattr(node, name, _lift(value, leaves))
        elif isinstance(value, list):
            setattr(
                node, name, [_lift(v, leaves) if isinstance(v, ast.expr) else _lift_keyword(v, leaves) for v in value]
            )
    return node


def _lift_keyword(item: object, leaves: list[str]) -> object:
    """Return a call keyword with its value lifted (other list items, e.g. operators, unchanged)."""
    if isinstance(item, ast.keyword):
        item.value = _lift(item.value, leaves)
    return item


def read_value(text: object) -> object:
    """Return the literal ``text`` denotes; LeafError when it is not a small, shallow Python literal."""
    if not isinstance(text, str) or len(text) > MAX_VALUE_CHARS:
        raise UnreadableValue(f"value is not a string of at most {MAX_VALUE_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError, OverflowError) as exc:
        raise UnreadableValue(f"returned non-literal value {text[:80]}") from exc
    stack, count = [(tree.body, 1)], 0
    while stack:
        node, depth = stack.pop()
        count += 1
        if depth > _MAX_VALUE_DEPTH or count > _MAX_VALUE_NODES:
            raise UnreadableValue(
                f"value nested deeper than {_MAX_VALUE_DEPTH} or larger than {_MAX_VALUE_NODES} nodes"
            )
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
    try:
        return ast.literal_eval(tree)
    except Exception as exc:  # any failure to read the value is that test's failure, never the trainer's
        raise UnreadableValue(f"returned non-literal value {text[:80]}") from exc


def _checked_size(value: object) -> object:
    """Return ``value`` unless it is too large to keep computing with."""
    if isinstance(value, int) and value.bit_length() > _MAX_INT_BITS:
        raise OverflowError("integer too large to judge")
    if isinstance(value, (str, bytes, list, tuple)) and len(value) > _MAX_SEQUENCE:
        raise OverflowError("sequence too large to judge")
    return value


def _binary(op: ast.operator, left: object, right: object) -> object:
    """Return ``left op right``, refusing operations whose result could be huge."""
    if (
        isinstance(op, ast.Pow)
        and isinstance(right, int)
        and isinstance(left, int)
        and (abs(right) > 4096 or left.bit_length() * abs(right) > _MAX_INT_BITS)
    ):
        raise OverflowError("power too large to judge")
    if isinstance(op, ast.LShift) and isinstance(right, int) and right > _MAX_INT_BITS:
        raise OverflowError("shift too large to judge")
    if isinstance(op, ast.Mult):
        for count, other in ((left, right), (right, left)):
            sized = isinstance(count, int) and isinstance(other, (str, bytes, list, tuple))
            if sized and count * max(len(other), 1) > _MAX_SEQUENCE:
                raise OverflowError("repetition too large to judge")
    if type(op) not in _BINARY:
        raise TypeError(f"operator {type(op).__name__} is not judged")
    return _checked_size(_BINARY[type(op)](left, right))


class _Judge:
    """Evaluates a lifted check over the values read back for its leaves."""

    def __init__(self, leaves: list[object]) -> None:
        self.leaves = leaves

    def value(self, node: ast.expr) -> object:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            if node.id.startswith(LEAF_PREFIX):
                found = self.leaves[int(node.id[len(LEAF_PREFIX) :])]
                if isinstance(found, LeafError):
                    raise found
                return found
            return _PURE_NAMES[node.id]
        if isinstance(node, ast.Attribute):
            return _MATH[node.attr]
        if isinstance(node, ast.BoolOp):
            return self.bool_op(node)
        if isinstance(node, ast.Compare):
            return self.compare(node)
        if isinstance(node, ast.UnaryOp):
            return _checked_size(_UNARY[type(node.op)](self.value(node.operand)))
        if isinstance(node, ast.BinOp):
            return _binary(node.op, self.value(node.left), self.value(node.right))
        if isinstance(node, ast.IfExp):
            return self.value(node.body) if self.value(node.test) else self.value(node.orelse)
        return self.container(node)

    def container(self, node: ast.expr) -> object:
        if isinstance(node, ast.Tuple):
            return tuple(self.value(e) for e in node.elts)
        if isinstance(node, ast.List):
            return [self.value(e) for e in node.elts]
        if isinstance(node, ast.Set):
            return {self.value(e) for e in node.elts}
        if isinstance(node, ast.Dict):
            return {self.value(k): self.value(v) for k, v in zip(node.keys, node.values)}
        if isinstance(node, ast.Subscript):
            return self.value(node.value)[self.value(node.slice)]
        if isinstance(node, ast.Slice):
            return slice(*(None if part is None else self.value(part) for part in (node.lower, node.upper, node.step)))
        if isinstance(node, ast.Call):
            function = self.value(node.func)
            args = [self.value(a) for a in node.args]
            return _checked_size(function(*args, **{k.arg: self.value(k.value) for k in node.keywords}))
        raise TypeError(f"{type(node).__name__} is not judged")

    def bool_op(self, node: ast.BoolOp) -> object:
        result = None
        for operand in node.values:
            result = self.value(operand)
            if bool(result) == isinstance(node.op, ast.Or):
                return result
        return result

    def compare(self, node: ast.Compare) -> bool:
        left = self.value(node.left)
        for op, right_node in zip(node.ops, node.comparators):
            right = self.value(right_node)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True


def judge(test: ParsedTest, leaf_values: list[object]) -> tuple[bool, str]:
    """Return (passed, reason) for ``test`` given its leaves' values (a LeafError for a failed leaf)."""
    try:
        passed = bool(_Judge(leaf_values).value(test.check.body))
    except LeafError as exc:
        return False, str(exc)[:300]
    except Exception as exc:  # the values come from the program: an error while judging fails the test
        return False, f"{type(exc).__name__}: {str(exc)[:200]}"
    if passed:
        return True, ""
    if test.expression is not None:
        got = leaf_values[0] if leaf_values else None
        return False, f"got {got!r:.80}, expected {test.expected!r:.80}"
    return False, "assertion failed"
